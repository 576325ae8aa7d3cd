"""ninfer-spec-mtp: the `--spec mtp` speculative backend (MTP drafts through a family's draft head)."""
