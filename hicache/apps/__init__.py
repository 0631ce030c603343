"""What runs on top of the cache rather than inside it: the reference engine
(:mod:`hicache.apps.engine`), the demo, and the trace replay with its offline bounds.

An engine that embeds hicache imports none of these; they exist to prove the cache exact
and to measure it.
"""
