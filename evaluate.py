"""
Evaluation and logs during training (train.py). Evaluation: each val source's mean token loss and their mixing-weighted total, logged
and written to metrics.jsonl. Every evaluation reads the first eval_iters batches of each source, the same rows
every time; the final one (--eval_whole=True, the default) reads every window of every val split once
(data.DataLoader.sweep), the number lab.py also scores. A masked-diffusion model (--stage=dlm) is scored by its
own loss (dlm.masked_diffusion_loss) with masks drawn from a generator seeded the same at every evaluation.
Each step's log line and metrics.jsonl record come from log_step.
Test: python -m pytest tests/test_train.py -k "whole_val or logged_ms"
"""

import torch

import dlm

DLM_EVAL_SEED = 1234  # the masks of every DLM evaluation
STAT_KEYS = ("grad_norm_raw", "grad_norm", "clipped", "z")  # as logged, from ZClip's raw_norm, clipped_norm, ...


@torch.no_grad()
def estimate_val_loss(run, whole=False):
    """(the mixing-weighted total, {source: val loss}): per source, the mean token loss over the first
    eval_iters * batch_size rows of its val split, or with whole=True over every window of it once
    (DataLoader.sweep). Each of W ranks reads its own rows of eval_iters / W global batches (rounded up), so when
    W divides eval_iters every world size reads the same rows."""
    model, rt = run.model, run.rt
    model.eval()
    by_source = {}
    gen = None if model.config.causal else torch.Generator(device=rt.device).manual_seed(DLM_EVAL_SEED)
    for name, (loader, _) in run.val_loaders.items():
        loader.reset()
        iters = -(-run.cfg.eval_iters // loader.world_size)
        batches = loader.sweep() if whole else (loader.next_batch() for _ in range(iters))
        sums = torch.zeros(2, device=rt.device)  # (sum of token losses, tokens)
        for x, y in batches:
            x, y = x.to(rt.device), y.to(rt.device)
            n = (y != -1).sum()
            with run.autocast:
                loss = run.train_model(x, y)[1].float() if gen is None else _dlm_loss(run, x, y, gen)
            sums += torch.stack([torch.where(n > 0, loss * n, 0.0), n.float()])  # an all-padding batch adds 0
        rt.all_reduce_(sums)
        by_source[name] = (sums[0] / sums[1]).item()
    model.train()
    return sum(w * by_source[n] for n, (_, w) in run.val_loaders.items()), by_source


def _dlm_loss(run, x, y, gen):
    """The masked-diffusion loss of the rows of x that are real windows (a sweep pads with rows of targets -1)."""
    rows = (y != -1).all(dim=1)
    if not rows.any():
        return torch.zeros((), device=x.device)
    mask_id = run.model.config.vocab_size - 1
    return dlm.masked_diffusion_loss(run.model, x[rows], mask_id, run.cfg.dlm_shift, generator=gen)[0].float()


def log_eval(run, rec):
    parts = [f"step {rec['step']}: val loss {rec['val_loss']:.4f}"]
    if "val_loss_by_source" in rec:
        parts.append("(" + ", ".join(f"{n} {v:.4f}" for n, v in rec["val_loss_by_source"].items()) + ")")
    if rec["whole_val"]:
        parts.append("over the whole val split")
    if "val_loss_avg" in rec:
        parts.append(f"; average of {run.average.count} checkpoints {rec['val_loss_avg']:.4f}")
    run.rt.log(" ".join(parts).replace(" ;", ";"))
    run.rt.log_json(run.out_dir, rec)


def log_step(run, step, out, n_bad, bad_run, timer):
    lam = out["lam"]
    if not out["ok"]:
        run.rt.log(f"step {step} | skipped: loss {out['loss']} grad norm {out['grad_norm_raw']} not finite, no "
                   f"update ({bad_run} in a row, {n_bad} in all; max_bad_steps={run.cfg.max_bad_steps})")
        run.rt.log_json(run.out_dir, {"step": step, "skipped": 1, "loss": None, "lambda": lam, "bad_steps": n_bad})
        return
    dt = timer.lap()
    tokens = run.cfg.batch_size * run.cfg.block_size * run.cfg.grad_accum
    rec = {"step": step, "loss": out["loss"], "lr": out["lr"], "lambda": lam,
           **{k: out[k] for k in STAT_KEYS}, "ms": 1000 * dt, "tok_per_s": tokens / dt,
           "muon_ms": out["muon_ms"], "bad_steps": n_bad, **out.get("parts", {}),
           **({"max_logit": out["max_logit"]} if "max_logit" in out else {})}
    rec["clipped"] = int(rec["clipped"])
    parts = out.get("parts")
    run.rt.log(f"step {step} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | grad norm "
               f"{rec['grad_norm_raw']:.3f} -> {rec['grad_norm']:.3f} (clipped {rec['clipped']}, z {rec['z']:.2f}) | "
               f"{rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s" +
               (f" | max logit {rec['max_logit']:.1f}" if "max_logit" in rec else "") +
               (" | " + " ".join(f"{k} {v:.4f}" for k, v in parts.items()) if parts else ""))
    run.rt.log_json(run.out_dir, rec)
