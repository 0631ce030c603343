"""Admin operations, in the store's process, and ``hicachectl``, a client process."""
