"""Process-group backends (tcp, nccl) and the machinery they share: one op ledger and one
watchdog."""
