"""The content-addressed stores: compiled partitions (compile cache) and machine-specific entries (machine cache)."""
