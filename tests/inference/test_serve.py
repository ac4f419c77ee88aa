"""The serve command's changes to daphne and Twisted keep their behaviour."""

from __future__ import annotations

import pytest
from twisted.web.http import _parseContentType

from inference.management.commands.serve import media_type


@pytest.mark.parametrize(
    "header",
    [
        b"application/json",
        b"Application/JSON; charset=utf-8",
        b"multipart/form-data; boundary=----x",
        b"application/x-www-form-urlencoded",
        b"  application/json  ;x=1",
        b'text/plain; charset="utf-8"',
        b"application/json charset",
        b"",
        b"text",
        b"a/b/c",
        b";",
        b"foo/bar;",
    ],
)
def test_the_content_type_is_read_as_twisted_reads_it(header: bytes) -> None:
    assert media_type(header) == _parseContentType(header)
