"""Tree components: FULL, SWA and MAMBA, one module each."""
