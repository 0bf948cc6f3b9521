"""The refbus wire: envelope, typed messages, array codec and errors. Imports no ZeroMQ."""
