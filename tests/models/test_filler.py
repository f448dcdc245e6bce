"""The simulated model's tokens follow from the sequence: the same ids after the same two ids,
whatever the request, so a continuation from delivered ids is exact in the engine itself."""

from __future__ import annotations

from qosgate.models.filler import context_of, next_id, text_ids, word
from qosgate.models.simmodel import SimEngine
from qosgate.models.step import SeqSpec
from tests.support.simmodel import TOY


def generate(seq_id: str, ids: tuple[int, ...], n: int) -> list[tuple[int, str]]:
    eng = SimEngine(TOY)
    eng.add(SeqSpec(seq_id, len(ids), n, context_ids=ids))
    out = []
    while eng.has_work():
        out += [(t.token_id, t.text) for t in eng.step().tokens]
    return out


def test_text_ids_count_four_characters_each() -> None:
    assert len(text_ids(b"x" * 41)) == 10
    assert len(text_ids(b"ab")) == 1
    assert text_ids(b"abcdefgh") == text_ids(b"abcdefgh")


def test_the_next_id_depends_on_the_last_two_only() -> None:
    assert context_of([7, 8, 9]) == context_of([1, 8, 9])
    assert next_id(context_of([7, 8, 9])) == next_id(context_of([1, 8, 9]))


def test_a_continuation_gives_the_same_ids_and_text() -> None:
    prompt = text_ids(b"a prompt of some length")
    whole = generate("first", prompt, 12)
    for k in (1, 3, 11):
        head = generate(f"head-{k}", prompt, k)
        tail = generate(f"tail-{k}", prompt + tuple(i for i, _ in head), 12 - k)
        assert head + tail == whole
        assert "".join(t for _, t in head + tail) == "".join(t for _, t in whole)


def test_a_prompted_sequence_spaces_every_word() -> None:
    out = generate("s", (3,), 2)
    assert [t for _, t in out] == [word(i) for i, _ in out]
    assert all(t.startswith(" ") for _, t in out)
