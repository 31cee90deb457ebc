"""python -m kvserve.bench.delta_rule: it runs on a preset's layer shape and prints each measurement; the
rollback it times recomputes the state the token-by-token form reaches after the accepted tokens."""
import torch

from kvserve.bench import delta_rule
from kvserve.model.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule


def test_it_prints_every_measurement(capsys):
    assert delta_rule.main(["--prompt", "70", "--repeat", "1", "--prompts", "4", "--prompt-tokens", "5"]) == 0
    out = capsys.readouterr().out
    for line in ("chunked form (the engine)", "its rollback, 3 tokens again", "token by token, every state made",
                 "36 linear layers: the state before the step 72.0 MiB; every token's state 360.0 MiB",
                 "whole vs cut at 23", "recurrent decode of 8 sequences vs each alone", "chunked form",
                 "4 prompts of 5 tokens", "  2 per call", "  4 per call", "4 fresh prompts of 5 tokens two to a call",
                 "flushed to zero"):
        assert line in out


def test_the_layer_shape_is_the_preset_s():
    assert delta_rule.layer_shape("qwen3-next-80b-a3b") == (36, 32, 128, 128)


def test_recomputing_the_accepted_tokens_reaches_the_token_by_token_state():
    *x, state = delta_rule.inputs(1, 5, 4, 16, 8)
    _, recomputed = chunked_gated_delta_rule(*(t[:, :3] for t in x), state)
    _, by_token = recurrent_gated_delta_rule(*(t[:, :3] for t in x), state)
    assert torch.allclose(recomputed, by_token, atol=1e-5)
