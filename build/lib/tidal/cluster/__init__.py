"""Cluster view shared by the live scheduler: who is alive, and where a request goes."""
