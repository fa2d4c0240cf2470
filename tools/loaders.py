"""
Where a run's data comes from, and its loaders: a shipped corpus named (--data=shakespeare,
tokenised into data/<name>_<tokenizer> the first time) or a directory of shards, each checked
against the run's tokenizer, mixed by weight (--data=dirA:0.7,python:0.3); then the train loader
(continuing a resumed run's position) and one val loader per source. The shard format and the loader
itself: data.py.
Test: python -m pytest tests/test_train.py tests/test_prepare.py
"""

import os
from types import SimpleNamespace

import data
from tokenizer import fingerprint, get_tokenizer
from tools import prepare
from tools.atomic import ROOT
from tools.config import parse_data
from tools.flags import die
from tools.prepare import same_source, source_slug

SHIPPED = ("shakespeare", "python")  # --data names of the corpora in data/ (prepare.CORPORA)


def shipped_dir(name, cfg):
    """data/<name>_<tokenizer>, the shards of a shipped corpus; tokenised (tools/prepare.py) the
    first time. A pretrained model's tokenizer is named by its source's last part
    (prepare.source_slug)."""
    root = shipped_root(name, cfg.tokenizer)
    scores = os.path.join(root, "train_000.difficulty.npy")  # the curriculum needs them
    if not os.path.exists(os.path.join(root, "meta.json")) or (cfg.data_order == "curriculum" and
                                                                not os.path.exists(scores)):
        print(f"no shards{' or no difficulty scores' if os.path.exists(root) else ''} in {root}; "
              f"tokenising the shipped corpus {name} (once)")
        prepare.prepare(tokenizer=cfg.tokenizer, out_dir=root, corpus=name)
    try:
        prepare.check_shipped(root, name)  # data of one's own prepared into it is not that corpus
    except ValueError as e:
        die(str(e), 2)
    return root


# where docs/gpu-node.md prepares FineWeb-Edu for the CUDA preset
FINEWEB_EDU = os.path.join(ROOT, "data", "fineweb_edu_gpt2")


def default_data(cfg):
    """--data="": FineWeb-Edu when it has been prepared (docs/gpu-node.md) and the run uses the
    GPT-2 tokenizer (the CUDA preset), else the shipped Shakespeare corpus."""
    if cfg.tokenizer == "gpt2" and os.path.exists(os.path.join(FINEWEB_EDU, "meta.json")):
        return {FINEWEB_EDU: 1.0}
    return {"shakespeare": 1.0}


def shipped_root(name, tokenizer):
    """data/<name>_<tokenizer>: where a shipped corpus's shards are (shipped_dir makes them)."""
    return os.path.join(ROOT, "data", f"{name}_{source_slug(tokenizer)}")


def data_dirs(data_flag, tokenizer):
    """The shard directories a --data value names, as resolve_data resolves them but nothing prepared
    or checked (the output checks: a run never writes into what it reads); a shipped corpus's name is
    resolved only with a tokenizer."""
    names = parse_data(data_flag) or default_data(SimpleNamespace(tokenizer=tokenizer))
    return [shipped_root(p, tokenizer) if p in SHIPPED and not os.path.isdir(p) and tokenizer else p
            for p in names]


def resolve_data(cfg):
    """The shard directories and mixing weights. A shipped corpus may be named instead of a
    directory (--data=shakespeare:0.75,python:0.25) and is prepared the first time; "" =
    default_data(cfg)."""
    sources = {shipped_dir(p, cfg) if p in SHIPPED and not os.path.isdir(p) else p: w
               for p, w in (parse_data(cfg.data) or default_data(cfg)).items()}
    for path in sources:
        try:
            # a dataset left between the two renames of a re-run: say where it is
            prepare.check_not_mid_swap(path)
        except ValueError as e:
            die(str(e))
        if not os.path.isdir(path):  # a typo, or a file of a dataset: not a place to make shards in
            what = "is a file, not a directory of shards" if os.path.exists(path) else "does not exist"
            die(f"--data={cfg.data}: {path} {what}; pass a directory tools.prepare made (it holds meta.json) "
                f"or a shipped corpus: {', '.join(SHIPPED)}")
        if not os.path.exists(os.path.join(path, "meta.json")):
            die(f"{path}: no meta.json; make shards with: python -m tools.prepare "
                f"--tokenizer={cfg.tokenizer} --out_dir={path} <files>")
        try:
            meta = data.read_meta(path)  # an empty or broken meta.json: one line naming it
        except ValueError as e:
            die(str(e))
        # the vocabulary itself: one model at two paths is one
        made_by = meta.get("tokenizer_fingerprint")
        mine = fingerprint(get_tokenizer(cfg.tokenizer)) if made_by else None
        if mine != made_by or not (made_by or same_source(meta["tokenizer"], cfg.tokenizer)):
            theirs = f" (fingerprint {made_by})" if made_by else ""
            ours = f" (fingerprint {mine})" if made_by else ""
            die(f"{path} was tokenised with {meta['tokenizer']}{theirs}, but "
                f"--tokenizer={cfg.tokenizer}{ours}; pass --tokenizer={meta['tokenizer']} or "
                "re-run tools/prepare.py")
    return sources


def make_loaders(cfg, rt, resume):
    """The train loader and {source name: (its val loader, mixing weight)} (rt: runtime.Runtime);
    local rank 0 of each node prepares the shipped corpora first. resume: a checkpoint whose loader
    position the train loader continues from."""
    try:
        if rt.local_rank == 0:
            sources = resolve_data(cfg)
        rt.barrier()
        if rt.local_rank != 0:
            sources = resolve_data(cfg)
        # the rows this run reads: one curriculum block
        span = cfg.max_iters * cfg.batch_size * cfg.grad_accum
        train_loader = data.DataLoader(sources, "train", cfg.batch_size, cfg.block_size, rt.rank,
                                       rt.world, cfg.seed, order=cfg.data_order, span=span)
        total = sum(sources.values())
        names = [os.path.basename(os.path.normpath(d)) for d in sources]
        # two dirs of one name: their paths
        names = names if len(set(names)) == len(names) else list(sources)
        val_loaders = {name: (data.DataLoader(d, "val", cfg.batch_size, cfg.block_size, rt.rank,
                                              rt.world, cfg.seed, order="sequential"), w / total)
                       for name, (d, w) in zip(names, sources.items())}
        if resume is not None:
            train_loader.load_state_dict(resume["loader"])
    except ValueError as e:
        die(str(e))
    have = [data.read_meta(d).get("train_tokens") for d in sources]
    epochs = span * cfg.block_size / sum(have) if None not in have and sum(have) > 0 else 0
    if epochs > 10:  # a 124M model on Shakespeare: hundreds of passes over 1.5M tokens
        rt.log(f"note: this run reads its training data {epochs:.0f} times over "
               f"({span * cfg.block_size:,} tokens); a model of this size will memorise it. For "
               "the CUDA preset prepare FineWeb-Edu (docs/gpu-node.md), which --data='' then "
               "uses, or pass a larger --data")
    return train_loader, val_loaders
