"""``--reasoning-parser`` (``services/router/reasoning.py``): thinking split from the answer, for any split of
the stream into chunks, as the whole text splits."""
import pytest

from services.router.reasoning import ReasoningSplit, split

TEXTS = {"qwen3": ["<think>\nplan: add 2 and 2</think>\n\nIt is 4.", "No thinking at all.", "<thi"],
         "deepseek_r1": ["plan: add</think>It is 4.", "<think>x</think>y", "unfinished thought"]}


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_any_chunking_splits_as_the_whole_text(parser):
    for text in TEXTS[parser]:
        want = split(parser, text)
        for size in (1, 2, 3, 5, len(text)):
            s = ReasoningSplit(parser)
            parts = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
            assert ("".join(r for r, _ in parts) if s.thought else None, "".join(c for _, c in parts)) == want


def test_the_split_itself():
    assert split("qwen3", "<think>\nplan</think>\n\nIt is 4.") == ("\nplan", "\n\nIt is 4.")
    assert split("qwen3", "No thinking.") == (None, "No thinking.")
    assert split("deepseek_r1", "plan</think>answer") == ("plan", "answer")
    assert split("deepseek_r1", "still thinking") == ("still thinking", "")
    with pytest.raises(ValueError):
        ReasoningSplit("other")
