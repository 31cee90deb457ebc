"""The workloads of `kvserve bench throughput`: the rewrite workload's real documents and prompts."""


def test_the_rewrite_workload_asks_to_correct_real_documents_of_the_stated_lengths():
    from kvserve.bench.rewrite import INSTRUCTION, RewriteWorkload
    from kvserve.model.loader import resolve_model

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    workload = RewriteWorkload()
    documents = workload.documents(tokenizer)
    lengths = [len(tokenizer(d, add_special_tokens=False).input_ids) for d in documents]
    assert len(documents) == 8 and all(300 <= n for n in lengths) and lengths == sorted(lengths)
    assert len(set(documents)) == 8
    prompts = workload.prompts(49152, tokenizer)
    text = tokenizer.decode(prompts[0])
    assert INSTRUCTION.strip() in text and documents[0][:100] in text and "<|im_start|>assistant" in text
    assert max(map(len, prompts)) + workload.output_len <= workload.max_len
