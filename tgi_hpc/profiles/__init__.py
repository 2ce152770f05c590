"""Cluster profiles: the schema, reading the shipped and user YAML, merging layers, validation errors
naming file and key, which cluster this machine is, and the clusters' job rules (wall time, whole nodes).

Core: imports only `tgi_hpc.errors` and `tgi_hpc.data` from the rest of the toolkit.
"""
