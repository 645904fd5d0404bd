"""The table of results/bytes/ragged-presses/ruler-dev.jsonl: each press's bytes over snapkv's on the same example,
ratio and dtype, averaged over examples and seeds (K and V; K, V and the SNIS bias).
  python results/bytes/ragged-presses/table.py"""
import pandas as pd

df = pd.read_json("results/bytes/ragged-presses/ruler-dev.jsonl", lines=True)
snap = df[df.press == "snapkv"].set_index(["example_id", "dtype", "compression_ratio"])[["kv_bytes"]]
df = df.join(snap.rename(columns={"kv_bytes": "snapkv"}), on=["example_id", "dtype", "compression_ratio"])
df["kv_x"] = df.kv_bytes / df.snapkv
df["all_x"] = (df.kv_bytes + df.bias_bytes) / df.snapkv
df["bias_x"] = df.bias_bytes / df.snapkv
seeds = df.groupby(["dtype", "press", "compression_ratio", "seed"])[["kv_x", "bias_x", "all_x"]].mean()
out = df.groupby(["dtype", "press", "compression_ratio"]).agg(
    examples=("example_id", "nunique"), seeds=("seed", "nunique"), kv_x=("kv_x", "mean"), bias_x=("bias_x", "mean"),
    all_x=("all_x", "mean"))
out["kv_x seed max"] = seeds.groupby(["dtype", "press", "compression_ratio"]).kv_x.max()
print(out.round(4).to_string())
