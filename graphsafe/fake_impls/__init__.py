"""Fake impls: output metadata (shape, dtype, device, strides) from input metadata only.

Nothing here touches tensor data, allocates real memory or imports graphsafe.workspace
(tests/test_static.py enforces the last rule). Each family module also holds the
`check_*` input validation that the real impls reuse, so both reject the same inputs.
"""
