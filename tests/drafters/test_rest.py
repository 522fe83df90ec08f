import numpy as np
import pytest

from tiny import VOCAB, reference_greedy, successor_model, tiny_model, word_tokenizer
from specula.datastore.build import BuildConfig, build_datastore
from specula.datastore.format import DatastoreError
from specula.drafters import make_drafter
from specula.drafters.base import DraftBudget, DraftContext
from specula.drafters.rest import RestConfig, RestDrafter, open_datastore
from specula.engine import SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import SamplingParams, make_generator


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def successor_store(tmp_path_factory, tokenizer):
    """Runs of consecutive ids (what the successor model generates) plus distractor runs."""
    root = tmp_path_factory.mktemp("succ")
    rng = np.random.default_rng(0)
    docs = [[(s + i) % VOCAB for i in range(rng.integers(5, 30))] for s in rng.integers(2, VOCAB, 60)]
    docs += [rng.integers(2, VOCAB, 20).tolist() for _ in range(40)]  # noise
    (root / "runs.jsonl").write_text("\n".join('{"text": "%s"}' % words(d) for d in docs))
    return build_datastore(tokenizer, [root / "runs.jsonl"], root / "succ.specds", BuildConfig(progress=False)).path


@pytest.fixture(scope="module")
def random_store(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("rand")
    rng = np.random.default_rng(1)
    (root / "c.txt").write_text(words(rng.integers(0, VOCAB, 30_000)))  # every bigram ~3 times
    return build_datastore(tokenizer, [root / "c.txt"], root / "rand.specds", BuildConfig(progress=False)).path


def ctx(tokens, max_nodes=64, max_depth=10):
    return DraftContext(list(tokens), 1, SamplingParams(), DraftBudget(max_nodes, max_depth), make_generator(0))


def decoder(model, store, tokenizer, **options):
    target = HFCausalLM(model, "target")
    drafter = make_drafter("rest", target=target, datastore=str(store), tokenizer=tokenizer, **options)
    return SpeculativeDecoder(target, drafter, eos_token_ids=[])


def test_rest_on_successor_model_is_lossless_and_accepts_drafts(successor_store, tokenizer):
    model = successor_model(VOCAB)
    dec = decoder(model, successor_store, tokenizer)
    for prompt in ([10, 11, 12], [50, 3, 70, 71], [95, 0]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 40)
        assert out.token_ids == [(prompt[-1] + 1 + i) % VOCAB for i in range(40)]
        assert out.stats.source_accepted["rest"] > 0
        assert out.stats.mean_accepted_tokens > 3.0


def test_rest_greedy_equals_plain_greedy_on_random_models(arch, random_store, tokenizer):
    model = tiny_model(arch, seed=7)
    dec = decoder(model, random_store, tokenizer)
    for prompt in ([3, 4, 5, 6], [11, 2, 7], [9]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 30), (arch, prompt)
        assert out.stats.drafted_tokens > 30  # a tree nearly every step


def test_rest_sampling_is_seeded_and_reproducible(random_store, tokenizer):
    model = tiny_model("qwen2", seed=8)
    params = SamplingParams(max_new_tokens=25, temperature=0.9, seed=5, ignore_eos=True)
    runs = [decoder(model, random_store, tokenizer).generate([3, 4, 5], params).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 25


def test_proposal_is_the_frequent_prefix_tree_within_budget(successor_store):
    drafter = RestDrafter(open_datastore(str(successor_store)))
    proposal = drafter.propose(ctx([40, 41, 42]))
    tree = proposal.tree
    assert proposal.q is None and proposal.sibling_mode == "deterministic"
    assert 0 < len(tree) <= 64 and tree.max_depth <= 10
    assert set(tree.sources) == {"rest"}
    assert tree.tokens[tree.children[0][0]] == 43  # the continuation the runs agree on
    for i, par in enumerate(tree.parents):
        assert 0 < tree.edge_scores[i] <= 1 and 0 < tree.path_scores[i] <= 1
        if par >= 0:
            assert tree.path_scores[i] <= tree.path_scores[par]
    for row in tree.children:  # deterministic siblings are distinct
        assert len({tree.tokens[c] for c in row}) == len(row)
    small = drafter.propose(ctx([40, 41, 42], max_nodes=5, max_depth=2)).tree
    assert len(small) <= 5 and small.max_depth <= 2
    assert drafter.propose(ctx([40], max_nodes=5)).tree.tokens == ()  # one token: below min_suffix
    assert drafter.propose(ctx([40, 41], max_depth=0)).tree.tokens == ()


def test_root_edge_scores_grow_with_the_matched_suffix_length(successor_store):
    drafter = RestDrafter(open_datastore(str(successor_store)))

    def root_edge(tokens):
        tree = drafter.propose(ctx(tokens)).tree
        return max(e for e, par in zip(tree.edge_scores, tree.parents) if par < 0)

    short, long = root_edge([7, 40, 41]), root_edge([36, 37, 38, 39, 40, 41])  # "40 41" vs 6 tokens
    assert short <= 0.5 < long <= 1.0


def test_context_ids_beyond_the_datastore_vocabulary_are_ignored(successor_store):
    drafter = RestDrafter(open_datastore(str(successor_store)), RestConfig(max_nodes=8))
    assert len(drafter.propose(ctx([40, 41, 42, 200, 17, 18])).tree) > 0  # searched with [17, 18]


def test_wrong_tokenizer_missing_file_and_small_target_are_refused(successor_store, tmp_path):
    other = word_tokenizer(VOCAB + 1)
    target = HFCausalLM(successor_model(VOCAB), "target")
    with pytest.raises(DatastoreError, match="not with this model's tokenizer"):
        make_drafter("rest", target=target, datastore=str(successor_store), tokenizer=other)
    with pytest.raises(ConfigError, match="pass datastore=FILE"):
        make_drafter("rest", target=target)
    with pytest.raises(ConfigError, match="need 2 <= min_suffix"):  # a one-token match would score 0
        make_drafter("rest", target=target, datastore=str(successor_store), min_suffix=1)
    with pytest.raises(DatastoreError, match="does not exist"):
        make_drafter("rest", target=target, datastore=str(tmp_path / "none.specds"))
    narrow = HFCausalLM(tiny_model("llama", vocab=64), "narrow")
    with pytest.raises(DatastoreError, match="64 logits"):
        make_drafter("rest", target=narrow, datastore=str(successor_store))


def test_cli_routes_the_datastore_option(successor_store):
    from specula.cli import build_parser
    from specula.commands.common import drafter_options

    args = build_parser().parse_args(["generate", "--target", "x", "--method", "rest", "--datastore",
                                      str(successor_store), "--prompt", "hi"])
    assert drafter_options(args, "rest")["datastore"] == str(successor_store)  # (a missing file: refused there)


def test_memory_footprint_is_the_mapped_datastore(successor_store):
    store = open_datastore(str(successor_store))
    drafter = RestDrafter(store)
    n = len(store.tokens)
    assert n > 0 and drafter.memory_bytes == store.tokens.nbytes + store.index.nbytes
    assert drafter.memory_bytes >= 2 * n  # at least 1 byte per token id and per suffix-array entry


def test_a_suffix_whose_matches_all_end_a_document_gives_way_to_a_shorter_one(tmp_path, tokenizer):
    """The longest suffix found may occur only at documents' ends (nothing follows it); a shorter
    suffix that goes on elsewhere is drafted from instead of nothing."""
    (tmp_path / "docs.jsonl").write_text('{"text": "%s"}\n{"text": "%s"}\n' % (words([20, 30, 31, 32]),
                                                                             words(range(31, 46))))
    store = build_datastore(tokenizer, [tmp_path / "docs.jsonl"], tmp_path / "d.specds", BuildConfig(progress=False))
    drafter = RestDrafter(open_datastore(str(store.path)), RestConfig())
    tree = drafter.propose(ctx([3, 30, 31, 32])).tree
    assert len(tree) > 0 and tree.tokens[0] == 33  # from "31 32" in the second document
