"""The transfer wing: moving a key's bytes between this daemon and its peers.

- ``machine.TransferMachine``: the protocol, without I/O: every transfer's state, and what
  each input (a request, a peer's message, a route's completion, a timer, a lost link)
  means, as actions.
- ``transfers.PeerTransfers``: the driver. It feeds the machine its inputs and carries out
  its actions.
- ``routes``: the one interface bytes move through (``SendRoute``, ``ReceiveRoute``,
  ``Moving``), over TCP or an NCCL channel, and which route a transfer takes.
- ``nccl_links.NcclLinks``: the NCCL channels per peer and device.
- ``arrivals.Arrivals``: the keys' side: where incoming bytes land, what a peer may read.
- ``leasing.Leasing``: renewals and releases asked of and answered to peers.

Imports run one way: the machine imports only ``protocol`` and ``errors``; the driver
imports everything else here.
"""
