"""Tests of the wire protocol: the verb table and field codecs."""
