"""Speculative decoding: DDTree / DFlash-chain draft trees (tree.py), the accept walk (accept.py), the decode
harness (decode.py) and the device-resident rounds (device_round.py, graph.py, device_decode.py)."""
