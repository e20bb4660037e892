"""The transfer wing: moving a key's bytes between this daemon and its peers.

``transfers.PeerTransfers`` runs the OFFER/ACCEPT/BUSY/REFUSE/DONE/FAILED exchange for
puts, pulls and cancels, and picks a TCP or an NCCL channel per transfer;
``nccl_links.NcclLinks`` keeps the NCCL channels per peer and device; ``waiting_pulls``
holds peers' pulls until their key appears; ``arrivals.Arrivals`` is the keys' side:
where incoming bytes land, and what a peer may read.
"""
