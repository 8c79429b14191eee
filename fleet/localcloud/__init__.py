"""The local cloud: a vast.ai-compatible marketplace whose hosts are real processes on this machine.

It is the embedded default provider (`local`) and the bed of every integration test. The same
client code talks to it and to vast.ai, so it answers with vast.ai's paths, fields and errors.
"""
