"""What the eviction backends' tests share: the reason their evictions carry."""

REASON = "trainwarden: FatalXid XID 79 on rank 1"
