"""ZeroMQ plumbing shared by every role."""
