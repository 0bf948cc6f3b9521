"""The durable store: bytes in tmpfs files that outlive the process, with a commit journal."""
