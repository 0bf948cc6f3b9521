"""Training arrays by reference: branches, packing, assembly."""
