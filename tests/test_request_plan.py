"""Typed request plans: what a sequence is (SequenceKind), its chunk plan by stage, and the
per-request reuse options declared once (ReuseOptions) and derived everywhere else."""

from __future__ import annotations

import dataclasses
import typing

import pydantic
import pytest

from chunkcache.config import REQUEST_CHUNK_OPTIONS, ChunkConfig, ReuseOptions
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.server.protocol.chat import ChatCompletionRequest
from chunkcache.server.protocol.completions import CompletionRequest


def test_each_reuse_option_overrides_a_chunk_config_field_of_its_type() -> None:
    chunk_types = typing.get_type_hints(ChunkConfig)
    for name, hint in typing.get_type_hints(ReuseOptions).items():
        target = REQUEST_CHUNK_OPTIONS[name]
        assert hint == chunk_types[target] | None, f"{name}: {hint} vs ChunkConfig.{target}"
    assert REQUEST_CHUNK_OPTIONS["chunk_layout"] == "layout"


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_protocol_derives_its_extension_fields_from_reuse_options(model: type) -> None:
    names = [f.name for f in dataclasses.fields(ReuseOptions)]
    assert set(names) <= set(model.model_fields)
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    assert model(**body).chunk_options() is None
    request = model(**body, chunk_layout="offset", blend_recompute_ratios=[0.5, 0.25], fusion_amateur=False)
    options = request.chunk_options()
    assert options == ReuseOptions(
        chunk_layout="offset", blend_recompute_ratios=(0.5, 0.25), fusion_amateur=False
    )
    with pytest.raises(pydantic.ValidationError) as info:
        model(**body, blend_check_layers="first")
    assert info.value.errors()[0]["loc"] == ("blend_check_layers",)


def test_reuse_options_merge_into_the_chunk_config_and_are_checked_there() -> None:
    merged = ChunkConfig().with_request_options(
        ReuseOptions.from_mapping(
            {"chunk_layout": "isolated", "blend_check_layers": [2], "blend_recompute_ratios": [0.3]}
        ),
        num_layers=4,
    )
    assert (merged.layout, merged.blend_check_layers, merged.blend_recompute_ratios) == (
        "isolated",
        (2,),
        (0.3,),
    )
    assert ChunkConfig().with_request_options(ReuseOptions(), 4) == ChunkConfig()
    with pytest.raises(ValueError, match=r"^unknown per-request chunk option 'max_chunks'"):
        ReuseOptions.from_mapping({"max_chunks": 3})
    with pytest.raises(ValueError, match=r"^blend_recompute_ratios must be in"):
        ChunkConfig().with_request_options(ReuseOptions(blend_recompute_ratios=(2.0,)), 4)


def test_sequence_kinds() -> None:
    fills = {k for k in SequenceKind if k.is_fill}
    background = {k for k in SequenceKind if k.is_background}
    assert fills == {SequenceKind.CHUNK_FILL, SequenceKind.CANONICAL_FILL, SequenceKind.PREWARM_FILL}
    assert background == {
        SequenceKind.CANONICAL_FILL,
        SequenceKind.PREWARM_FILL,
        SequenceKind.PREFIX_JOB,
        SequenceKind.SHADOW,
    }
    # Background work in KV blocks of its own: a waiting request takes them back.
    assert {k for k in SequenceKind if k.yields_blocks} == {SequenceKind.PREFIX_JOB, SequenceKind.SHADOW}
    assert not SequenceKind.REQUEST.is_fill and not SequenceKind.REQUEST.is_background


def test_no_sequence_field_is_untyped() -> None:
    """Sequence's fields name their types: no `Any`, no role flags beside `kind`."""
    for f in dataclasses.fields(Sequence):
        assert "Any" not in str(f.type), f"Sequence.{f.name}: {f.type}"
    names = {f.name for f in dataclasses.fields(Sequence)}
    assert not names & {"is_fill", "background", "is_prewarm", "chunk_state", "chunk_config"}
