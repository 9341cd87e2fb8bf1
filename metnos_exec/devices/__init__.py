"""Devices: signing, packability, fetch, runtimes, the catalog."""
