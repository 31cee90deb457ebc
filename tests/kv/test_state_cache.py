"""State slots of hybrid models: taken with a sequence's first blocks, refused when none is free, freed on free,
copied for a fork; the storage's bytes are the planner's. Checkpoints: evicted by value (hits and depth), one whose
block the pool lost first, never one waiting for its step or one an admission still copies; given back when their
block never came (freed first, trimmed). A step's slots: read and written in place when they are one run, through
copies otherwise; prompt chunks cut at their checkpoints into rounds of at most a batch's pieces."""
import pytest
import torch

from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.kv.resume import DECODE, PROMPT_END
from kvserve.kv.state_cache import (SlotBatch, StateCache, StateCheckpoints, StateShape, StateSlots, delta_rule_step_,
                                    prompt_rounds)
from kvserve.planner.capacity import plan_kv_cache
from kvserve.planner.model_spec import ModelSpec
from tests.kv.sequences import Seq

SHAPE = StateShape(num_layers=3, conv_dim=96, conv_tail=3, num_value_heads=4, key_head_dim=16, value_head_dim=8)


def test_slots_are_taken_freed_and_reused():
    slots = StateSlots(2)
    assert slots.take("a") == 0 and slots.take("a") == 0  # a request keeps its slot
    assert slots.take("b") == 1
    assert not slots.can_take("c") and slots.can_take("a")
    slots.free("a")
    assert slots.can_take("c") and slots.take("c") == 0
    slots.free("missing")  # nothing held: nothing to do
    assert slots.num_free_slots == 0


def test_fork_queues_a_copy_and_refuses_without_a_free_slot():
    slots = StateSlots(3)
    slots.take("parent")
    slots.fork("parent", "child")
    assert slots.take_copies() == [(0, 1)] and slots.take_copies() == []
    slots.fork("parent", "child2")
    slots.free("child2")  # freed before the copy ran: the copy is dropped
    assert slots.take_copies() == []
    slots.take("other")
    with pytest.raises(ValueError, match="no free state slot to fork 'parent'"):
        slots.fork("parent", "child3")
    with pytest.raises(ValueError, match="at least one slot"):
        StateSlots(0)


def test_cache_copies_every_layer_of_a_slot():
    cache = StateCache(SHAPE, num_slots=3)
    assert cache.nbytes == 3 * SHAPE.slot_bytes
    cache.conv[:, 0] = torch.randn(3, 3, 96)  # [layer, slot, kernel - 1, conv_dim]
    cache.recurrent[:, 0] = torch.randn(3, 4, 8, 16)  # [layer, slot, value heads, value dim, key dim]
    cache.copy([(0, 2)])
    assert torch.equal(cache.conv[:, 2], cache.conv[:, 0]) and torch.equal(cache.recurrent[:, 2], cache.recurrent[:, 0])
    assert not cache.conv[:, 1].any()


def test_coordinator_takes_a_slot_with_the_first_blocks_and_frees_it():
    kv = KVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=False, state_slots=1)
    a, b = Seq("a", list(range(20))), Seq("b", list(range(20)))
    assert kv.allocate(a, 20) is not None and kv.state.slot("a") == 0
    assert kv.allocate(b, 20) is None  # blocks are free, the one slot is not
    assert kv.pool.num_free_blocks == 6 and not kv.state.has_slot("b")
    kv.free(a)
    assert kv.state.num_free_slots == 1 and kv.pool.num_free_blocks == 8
    assert kv.allocate(b, 20) is not None and kv.state.slot("b") == 0


def test_coordinator_fork_shares_blocks_and_copies_the_slot():
    kv = KVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=False, state_slots=2)
    parent, child = Seq("p", list(range(20))), Seq("c", list(range(20)))
    kv.allocate(parent, 20)
    kv.fork(parent, child)
    assert kv.state.take_copies() == [(0, 1)]
    assert kv.block_ids("c") == kv.block_ids("p")
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 8 and kv.state.num_free_slots == 2


def test_coordinator_refuses_prefix_caching_with_state_slots():
    with pytest.raises(ValueError, match="prefix caching with state slots"):
        KVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=True, state_slots=2)


def test_planner_slot_bytes_are_the_storage_bytes():
    config = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=64,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  max_position_embeddings=1024, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, torch_dtype="float32",
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
    spec = ModelSpec.from_hf_config(config, name="tiny")
    plan = plan_kv_cache(spec, 2**20, 16, "fp32", 256, state_slots=5)
    assert plan.state.num_slots == 5 and plan.state.num_linear_layers == 3
    assert plan.state.slot_bytes == SHAPE.slot_bytes
    assert StateCache(SHAPE, 5).nbytes == plan.state.total_bytes
    assert plan.num_blocks == (2**20 - plan.state.total_bytes) // plan.block_bytes
    assert "state cache: 5 slots" in plan.summary_line()


def test_checkpoints_are_evicted_by_value_deeper_and_hit_ones_kept_longer():
    held = {b"a", b"b", b"c", b"d", b"e"}
    checkpoints = StateCheckpoints(first_slot=4, num_slots=3, held=lambda key: key in held)
    slots = {key: checkpoints.take(key, depth) for key, depth in ((b"a", 2), (b"b", 4), (b"c", 1))}
    assert sorted(slots.values()) == [4, 5, 6]
    for key in slots:
        checkpoints.filled(key)
    # values: clock 0 + (hits + 1) x depth: a 2, b 4, c 1: the shallowest, never hit, goes
    assert checkpoints.take(b"d", 1) == slots[b"c"] and not checkpoints.contains(b"c")
    checkpoints.filled(b"d")  # the clock rose to 1: d is worth 1 + 1 = 2, a tie with a, older: a goes first
    assert checkpoints.victim() == b"a"
    checkpoints.hit(slots[b"a"])
    checkpoints.hit(slots[b"a"])  # a: 1 + 3 x 2 = 7, above b's 4
    assert checkpoints.num_hits == 2 and checkpoints.victim() == b"d"
    assert checkpoints.take(b"e", 3) == checkpoints.lookup(b"e") and not checkpoints.contains(b"d")
    assert checkpoints.victim() == b"b"  # e is not filled yet (its step has not run): never a victim
    held.discard(b"a")  # the pool lost a's block: worthless, it goes before any other
    assert checkpoints.victim() == b"a"
    checkpoints.release(b"a")
    assert checkpoints.lookup(b"a") is None and len(checkpoints) == 2


def test_a_branch_point_starts_with_the_hit_it_missed():
    checkpoints = StateCheckpoints(first_slot=0, num_slots=2)
    checkpoints.take(b"branch", 3, hits=1)  # worth (1 + 1) x 3 = 6
    checkpoints.take(b"own end", 4)  # worth 4: shallower value, though deeper
    for key in (b"branch", b"own end"):
        checkpoints.filled(key)
    assert checkpoints.victim() == b"own end" and checkpoints.num_hits == 0  # a starting hit is not a hit served


def test_no_checkpoint_is_taken_while_every_slot_waits_for_its_step():
    checkpoints = StateCheckpoints(first_slot=0, num_slots=1)
    assert checkpoints.take(b"a", 1) == 0
    assert checkpoints.take(b"b", 5) is None and checkpoints.contains(b"a")
    checkpoints.filled(b"a")
    assert checkpoints.take(b"b", 5) == 0 and not checkpoints.contains(b"a")


def test_a_decoding_sequence_keeps_its_newest_checkpoint_and_a_hit_restores_it():
    kv = KVCacheManager(num_blocks=16, block_size=16, enable_prefix_caching=True, state_slots=2,
                        state_checkpoints=2)
    seq = Seq("a", list(range(70)))
    assert kv.allocate(seq, 70) is not None
    first = kv.plan_checkpoint(seq, 32, DECODE)
    second = kv.plan_checkpoint(seq, 48, DECODE)  # gives the one at 32 back
    assert first == second == 2 and len(kv.checkpoints) == 1
    assert kv.plan_checkpoint(seq, 48, DECODE) is None  # saved there already
    seq.num_computed_tokens = 70
    kv.cache_full_blocks(seq)
    kv.free(seq)
    again = Seq("b", list(range(70)))
    hit = kv.find_cached_prefix(again)
    assert hit.num_blocks == 3 and hit.state_checkpoint == 2  # 4 blocks of KV cached, the state only at 48
    kv.allocate(again, 70 - 48, hit)
    assert kv.state.take_copies() == [(2, kv.state.slot("b"))] and kv.checkpoints.num_hits == 1


def test_a_checkpoint_whose_step_never_registered_its_block_is_given_back():
    kv = KVCacheManager(num_blocks=16, block_size=16, enable_prefix_caching=True, state_slots=2,
                        state_checkpoints=2)
    seq = Seq("a", list(range(40)))
    assert kv.allocate(seq, 40) is not None
    assert kv.plan_checkpoint(seq, 32, PROMPT_END) == 2 and kv.checkpoints.num_waiting == 1
    assert kv.plan_checkpoint(seq, 48, DECODE) is None  # past its tokens (a draft's): not known to stay
    kv.free(seq)  # freed before cache_full_blocks registered the block (its step never ran)
    assert len(kv.checkpoints) == 0 and kv.checkpoints.num_waiting == 0


def test_trimmed_tokens_give_their_checkpoints_back_and_registered_ones_stay():
    kv = KVCacheManager(num_blocks=16, block_size=16, enable_prefix_caching=True, state_slots=2,
                        state_checkpoints=2)
    seq = Seq("a", list(range(50)))
    assert kv.allocate(seq, 50) is not None
    kv.plan_checkpoint(seq, 16, PROMPT_END)
    seq.num_computed_tokens = 20
    kv.cache_full_blocks(seq)  # block 1 registered: its checkpoint is saved and may be evicted from now on
    kv.plan_checkpoint(seq, 32, DECODE)
    assert kv.checkpoints.num_waiting == 1
    kv.trim(seq)  # the tokens up to 32 were rejected drafts: 20 computed
    assert len(kv.checkpoints) == 1 and kv.checkpoints.num_waiting == 0
    kv.free(seq)
    assert len(kv.checkpoints) == 1  # the prompt's stays for a later hit


def test_a_checkpoint_an_admission_restores_is_not_overwritten_before_its_copy():
    kv = KVCacheManager(num_blocks=16, block_size=16, enable_prefix_caching=True, state_slots=2,
                        state_checkpoints=1)
    seq = Seq("a", list(range(40)))
    kv.allocate(seq, 40)
    slot = kv.plan_checkpoint(seq, 32, PROMPT_END)
    seq.num_computed_tokens = 40
    kv.cache_full_blocks(seq)
    kv.free(seq)
    again = Seq("b", list(range(40)))
    hit = kv.find_cached_prefix(again)
    kv.allocate(again, 40 - 32, hit)  # queues the copy from the checkpoint's slot
    assert hit.state_checkpoint == slot and kv.checkpoints.victim() is None
    assert kv.plan_checkpoint(Seq("c", list(range(100, 140))), 32, PROMPT_END) is None  # no slot to take
    assert kv.state.take_copies() == [(slot, kv.state.slot("b"))]
    assert kv.checkpoints.victim() is not None  # copied: it may go now


@pytest.mark.parametrize("slots, in_place", [([1, 2, 3], True), ([0, 2, 3], False)])
def test_a_run_of_slots_is_updated_in_place_and_others_through_copies(slots, in_place):
    pool = torch.arange(5.0).view(5, 1).repeat(1, 2)
    batch = SlotBatch.of(slots, "cpu")
    states = batch.read(pool)
    assert (states.data_ptr() == pool[slots[0]].data_ptr()) == in_place
    states.mul_(10)  # an update in place, as the decode step makes it
    batch.write(pool, states)
    assert pool[:, 0].tolist() == [s * 10.0 if s in slots else float(s) for s in range(5)]


def test_prompt_chunks_are_cut_at_their_checkpoints_into_rounds_of_at_most_a_batch():
    # (rows of the flat batch, slot, fresh, [(tokens before the checkpoint, checkpoint slot)])
    chunks = [(slice(0, 20), 3, True, [(16, 9)]), (slice(20, 25), 0, False, []), (slice(25, 57), 1, True, [(16, 8)])]
    rounds = prompt_rounds(chunks, max_batch=2, device="cpu")
    assert [r.slots.slots.tolist() for r in rounds] == [[0, 1], [3], [1, 3]]  # slot order; a run of 2, then 1
    assert [r.lengths.tolist() for r in rounds] == [[5, 16], [16], [16, 4]]
    assert [r.fresh.view(-1).tolist() for r in rounds] == [[False, True], [True], [False, False]]
    assert [r.all_fresh for r in rounds] == [False, True, False]  # the one round whose layers read no state
    assert rounds[0].rows[0].tolist() == [20, 21, 22, 23, 24] + [24] * 11  # padding repeats the last real row
    assert rounds[0].real.sum(1).tolist() == [5, 16]
    assert [r.checkpoints for r in rounds] == [[(1, 8)], [(3, 9)], []]  # saved after the piece before them


def test_the_compiled_decode_step_equals_the_eager_one_for_any_batch():
    cache = StateCache(SHAPE, num_slots=6, compile_update=True)
    cache.warm_up()  # two graphs: the pool's view and a copy, each for any number of states
    assert cache.update_kind() == "compiled" and len(cache.compiled_update.graphs.graphs) == 2
    gen = torch.Generator().manual_seed(0)
    cache.recurrent.copy_(torch.randn(cache.recurrent.shape, generator=gen))
    dk, dv = SHAPE.key_head_dim, SHAPE.value_head_dim
    with torch.inference_mode():
        for states in (cache.recurrent[1, 2:5], cache.recurrent[2].index_select(0, torch.tensor([0, 3, 5]))):
            flat = states.view(-1, dv, dk)
            n = flat.shape[0]  # 12 states: neither warm-up batch
            q, k = torch.randn(n, dk, generator=gen), torch.randn(n, dk, generator=gen)
            v, decay = torch.randn(n, dv, generator=gen), torch.rand(n, generator=gen)
            beta = torch.rand(n, generator=gen)
            before = flat.clone()
            expected = flat.clone()
            expected_reads = delta_rule_step_(expected, q, k, v, decay, beta)
            assert cache.compiled_update((flat.clone(), q, k, v, decay, beta)) is not None  # a graph takes it
            reads = cache.delta_rule_step(flat, q, k, v, decay, beta)
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(reads, expected_reads))
            assert torch.allclose(flat, expected, rtol=1e-6, atol=1e-6)
            # the rule itself: S q of the states before the token, u = beta (v - decay S k), S = decay S + u k^T
            assert torch.allclose(expected_reads[0], (before @ q[:, :, None])[..., 0], atol=1e-5)
            u = beta[:, None] * (v - decay[:, None] * (before @ k[:, :, None])[..., 0])
            assert torch.allclose(expected_reads[1], u, atol=1e-5)
            assert torch.allclose(expected, decay[:, None, None] * before + u[:, :, None] * k[:, None, :], atol=1e-5)
    assert not StateCache(SHAPE, num_slots=2).compiled_update  # eager unless asked
