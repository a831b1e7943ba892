"""Which bytes a ``Range`` header asks for (``jobs.content.byte_range``): one range of any of the three forms, clamped
to the file; past the end is not satisfiable; anything else (several ranges, another unit, a malformed one) is the
whole file, as RFC 9110 lets a server answer."""

from __future__ import annotations

import pytest

from stage_runtime.jobs.content import byte_range


@pytest.mark.parametrize(("header", "size", "wanted"), [
    ("bytes=0-99", 1000, (0, 99)),
    ("bytes=100-", 1000, (100, 999)),
    ("bytes=-100", 1000, (900, 999)),
    ("bytes=-5000", 1000, (0, 999)),                  # a suffix longer than the file: all of it
    ("bytes=990-5000", 1000, (990, 999)),             # clamped to the last byte
    ("bytes=999-999", 1000, (999, 999)),
    ("bytes=1000-", 1000, False),                     # starts past the end: 416
    ("bytes=-0", 1000, False),
    ("bytes=5-1", 1000, None),                        # malformed: ignored
    ("bytes=0-1,5-9", 1000, None),                    # several ranges: the whole file
    ("items=0-5", 1000, None),
    ("bytes=-", 1000, None),
    (None, 1000, None),
])
def test_one_byte_range_is_read_from_the_header(header, size, wanted):
    assert byte_range(header, size) == wanted
