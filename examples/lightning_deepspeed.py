"""Fine-tune a causal LM under PyTorch Lightning's DeepSpeed ZeRO-3 strategy, loaded through lowmem_hf in
``LightningModule.configure_model``.

Lightning calls ``configure_model`` inside ``deepspeed.zero.Init``, but ``from_pretrained`` (transformers' and
lowmem_hf's) sees ZeRO-3 only through an ``HfDeepSpeedConfig`` that is alive while it runs, and Lightning never
creates one. ``configure_model`` therefore creates it from ``trainer.strategy.config`` and keeps a reference to it.
lowmem_hf then builds the model under ``deepspeed.zero.Init`` as transformers does, and each rank reads only its
own partition of every parameter (about 1/N of the checkpoint on N ranks). Each rank prints how much it holds and
how many bytes it read, then its training losses::

    python examples/lightning_deepspeed.py [--model PATH] [--devices 2]                           # GPUs
    DS_ACCELERATOR=cpu python examples/lightning_deepspeed.py --devices 2 --allow-cpu-deepspeed   # CPU (gloo)

Lightning starts the other processes itself; under ``torchrun``, pass ``--devices`` equal to
``--nproc-per-node``. Without ``--model``, the script builds a tiny random Llama in the temp directory and uses
it. ``--loader transformers`` loads with transformers' own ``from_pretrained`` instead, as the reference run: the
losses are the same. The data is a small fixed set of random token ids (labels = input ids), so the script needs
no tokenizer and no network.

On a machine without GPUs, ``--allow-cpu-deepspeed`` is needed: see ``CPUDeepSpeedStrategy`` below.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_tp import make_dataset  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local model folder (save_pretrained output); default: a tiny random Llama")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loader", choices=["lowmem", "transformers"], default="lowmem")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--allow-cpu-deepspeed", action="store_true", help="run Lightning's DeepSpeed strategy on CPU")
    return p.parse_args(argv)


def tiny_llama() -> str:
    """A tiny random Llama checkpoint, built once into the temp directory and shared by every rank.

    Each rank that finds no model builds one under a private name, then renames it into place. A rename fails
    when another rank got there first, and that rank's copy is identical because the seed is fixed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(tempfile.gettempdir(), "lowmem_hf_example_tiny_llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        )
        staging = tempfile.mkdtemp(dir=tempfile.gettempdir())
        LlamaForCausalLM(config).save_pretrained(staging)
        try:
            os.rename(staging, path)
        except OSError:
            shutil.rmtree(staging)
    return path


def cpu_deepspeed_strategy(stage: int):
    """Lightning's ``DeepSpeedStrategy`` made to run on CPU processes (gloo).

    DeepSpeed itself trains on CPU (``DS_ACCELERATOR=cpu``). Lightning's strategy raises in ``setup_environment``
    for any accelerator other than CUDA, and it expects indexed devices. It checks that each device's index is
    the process's local rank, and it passes ``root_device.index`` to ``deepspeed.initialize`` as
    ``device_rank``, which is ``None`` for a plain ``cpu`` device. The subclass skips exactly that CUDA check
    and gives the CPU devices indices. Nothing else changes: the ZeRO-3 config, ``zero.Init`` around
    ``configure_model``, the engine and the checkpointing are Lightning's own. Use it only when asked.
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            DDPStrategy.setup_environment(self)  # what DeepSpeedStrategy does after its CUDA-only check

    return CPUDeepSpeedStrategy(stage=stage)


def checkpoint_bytes(path: str) -> int:
    files = glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin"))
    return sum(os.path.getsize(f) for f in files)


def make_module(args):
    import lightning as L

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None
            self.losses = []

        def configure_model(self):
            if self.model is not None:  # Lightning may call the hook again (fit, then validate, ...)
                return
            from transformers.integrations import HfDeepSpeedConfig

            # Lightning has no HfDeepSpeedConfig; without one from_pretrained does not see ZeRO-3. transformers
            # holds only a weak reference to it, so keep it alive as long as the model.
            self.hf_ds_config = HfDeepSpeedConfig(self.trainer.strategy.config)
            if args.loader == "lowmem":
                from lowmem_hf import LowMemAutoModelForCausalLM

                self.model = LowMemAutoModelForCausalLM.from_pretrained(args.model)
            else:
                from transformers import AutoModelForCausalLM

                self.model = AutoModelForCausalLM.from_pretrained(args.model)
            self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodules' modes

            params = list(self.model.parameters())
            assert all(hasattr(p, "ds_tensor") for p in params), "not partitioned: is ZeRO-3 enabled?"
            local = sum(p.ds_tensor.numel() for p in params)
            full = sum(p.ds_numel for p in params)
            report = getattr(self.model, "lowmem_report", None)
            read = "(transformers)"
            if report is not None:
                read = f"read {report.bytes_read} of {checkpoint_bytes(args.model)} checkpoint bytes"
            print(f"rank {self.global_rank}: holds {local} of {full} parameter elements (ZeRO-3); {read}", flush=True)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    return CausalLM()


def main(argv=None):
    args = parse_args(argv)
    args.model = args.model or tiny_llama()

    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from transformers import AutoConfig

    L.seed_everything(args.seed, verbose=False)
    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    dataset = make_dataset(vocab_size, args.batch_size * args.devices * args.steps, args.seq_len, args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size)  # Lightning adds a DistributedSampler

    strategy = cpu_deepspeed_strategy(stage=3) if args.allow_cpu_deepspeed else DeepSpeedStrategy(stage=3)
    trainer = L.Trainer(
        accelerator="cpu" if args.allow_cpu_deepspeed else "auto",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = make_module(args)
    trainer.fit(module, loader)
    print(f"rank {trainer.global_rank}: losses {[round(x, 6) for x in module.losses]}", flush=True)


if __name__ == "__main__":
    main()
