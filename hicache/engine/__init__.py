"""The reference engine: a tiny hybrid model and a scheduler that uses the cache."""
