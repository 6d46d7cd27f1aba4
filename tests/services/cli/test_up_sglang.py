"""`tidal up --engine sglang`: each instance's --sglang-* options."""

from __future__ import annotations

import argparse

import pytest

from services.cli.up import sglang_args


def ns(urls: str = "", extra: str = "", python: str = "") -> argparse.Namespace:
    return argparse.Namespace(sglang_urls=urls, sglang_args=extra, sglang_python=python)


def test_each_instance_attaches_to_its_own_server_in_slot_order() -> None:
    a = ns("http://a:30000,http://b:30000", "--tp 2", "/opt/sgl/bin/python")
    assert sglang_args(a, 1, 2) == [
        "--sglang-url",
        "http://b:30000",
        "--sglang-args",
        "--tp 2",
        "--sglang-python",
        "/opt/sgl/bin/python",
    ]
    assert sglang_args(ns(), 0, 2) == []  # each instance starts its own SGLang


def test_a_server_count_that_does_not_match_the_instances_is_an_error() -> None:
    with pytest.raises(ValueError, match="1 server"):
        sglang_args(ns("http://a:30000"), 0, 2)


def test_decode_urls_pair_instances_with_a_decode_server() -> None:
    a = ns("http://p0:30000,http://b:30000")
    a.sglang_decode_urls = "http://d0:30000,"  # instance 1 drives one server
    assert sglang_args(a, 0, 2) == [
        "--sglang-url",
        "http://p0:30000",
        "--sglang-decode-url",
        "http://d0:30000",
    ]
    assert sglang_args(a, 1, 2) == ["--sglang-url", "http://b:30000"]
    a.sglang_decode_urls = "http://d0:30000"
    with pytest.raises(ValueError, match="1 server"):
        sglang_args(a, 0, 2)
