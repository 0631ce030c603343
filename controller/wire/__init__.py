"""The wire, in both processes: the protocol, the verb table, field codecs, peer security."""
