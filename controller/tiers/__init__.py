"""Lower tiers behind the host pool, in the store's process: the LMDB and remote tiers."""
