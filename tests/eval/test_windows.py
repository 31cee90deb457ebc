"""Sliding-window perplexity: every token after the first is scored exactly once, in the window where it is new,
and after the first window with at least context - stride tokens before it."""
import pytest

from kvserve.eval.windows import sliding_windows


@pytest.mark.parametrize("num_tokens, context, stride", [(1000, 256, 64), (257, 256, 64), (100, 256, 128), (2, 2, 1)])
def test_every_token_after_the_first_is_scored_once(num_tokens, context, stride):
    windows = sliding_windows(num_tokens, context, stride)
    scored = [t for w in windows for t in range(w.end - w.num_scored, w.end)]
    assert sorted(scored) == list(range(1, num_tokens))
    for w in windows[1:]:
        assert w.end - w.start <= context and (w.end - w.num_scored) - w.start >= context - stride
    assert windows[-1].end == num_tokens


@pytest.mark.parametrize("context, stride", [(256, 256), (256, 300), (256, 0)])
def test_stride_must_be_smaller_than_context(context, stride):
    with pytest.raises(ValueError, match="must be positive and smaller than context"):
        sliding_windows(1000, context, stride)
