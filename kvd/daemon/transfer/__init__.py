"""The transfer wing: moving a key's bytes between this daemon and its peers.

- ``machine.TransferMachine``: what each OFFER/ACCEPT/BUSY/REFUSE/DONE/FAILED means, and
  the eager-ordering rule, without I/O (events in, actions out).
- ``transfers.PeerTransfers``: the driver. It feeds the machine the peer's messages,
  carries out its actions, and runs our pulls; its parts (``context.TransferPart``) run
  the rest: ``sending.Sender`` (a push), ``receiving.Receiver`` (an offer and its bytes),
  ``serving.PullServer`` (a peer's pull).
- ``routes``: the one interface bytes move through (``SendRoute``, ``ReceiveRoute``,
  ``Moving``), over TCP or an NCCL channel, and which route a transfer takes.
- ``nccl_links.NcclLinks``: the NCCL channels per peer and device.
- ``waiting_pulls``: peers' pulls held until their key appears.
- ``arrivals.Arrivals``: the keys' side: where incoming bytes land, what a peer may read.

Imports run one way: machine and routes know nothing of the driver; the parts import
context; transfers imports the parts.
"""
