"""Token files as every reader takes them (the exporter's token files, the probe's, ``push`` and the plugin)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.tokens import TokenError, read_token, secret_text


@pytest.mark.parametrize("data", [b"s3cr3t\n", b"\xef\xbb\xbfs3cr3t\r\n", b"  s3cr3t  ", b"\xef\xbb\xbf s3cr3t\n"])
def test_a_byte_order_mark_and_the_white_space_around_a_token_are_no_part_of_it(tmp_path: Path, data: bytes) -> None:
    """Editors on Windows start a UTF-8 file with a byte-order mark; no token starts with one."""
    (tmp_path / "token").write_bytes(data)
    assert read_token(tmp_path / "token") == secret_text(data) == "s3cr3t"


def test_a_mark_inside_the_token_is_kept_for_the_bearer_check_to_refuse(tmp_path: Path) -> None:
    assert secret_text(b"s3\xef\xbb\xbfcr3t") == "s3\ufeffcr3t"


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "token").write_bytes(b"\xff\xfes\x00")
    with pytest.raises(TokenError, match=f"{tmp_path / 'token'}: not UTF-8 text"):
        read_token(tmp_path / "token")
