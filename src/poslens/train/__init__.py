"""Train decoders with and without positional encoding (`poslens train`, `poslens tokenize`)."""
