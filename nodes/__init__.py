"""Node roles and the `refbus` command line."""
