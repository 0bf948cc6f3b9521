"""The refbus wire: envelope, typed messages, array codec and errors. Imports no ZeroMQ.

Importing the package registers every message kind (each ``messages*`` module registers its own).
"""

from . import messages, messages_ps

__all__ = ["messages", "messages_ps"]
