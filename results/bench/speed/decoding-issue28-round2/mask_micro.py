# Micro-benchmark of one corrected layer call on the decode bench's shapes (issue 28 item 4, round 2): run with
# PYTHONPATH=$PWD OMP_NUM_THREADS=1 python results/bench/speed/decoding-issue28-round2/mask_micro.py (microseconds per call).
# Before the change corrected_sdpa took 78 us (same machine, 19:20 UTC); after, the output in mask_micro.txt.
import time, torch, torch.nn.functional as F
torch.set_num_threads(1)
from kvpress_prob.correction.attention import corrected_sdpa
b,hq,hkv,d,S,new = 1,9,3,64,512,16
q=torch.randn(b,hq,1,d); k=torch.randn(b,hkv,S+new,d); v=torch.randn(b,hkv,S+new,d); bias=torch.randn(b,hkv,S)
def t(f, n=3000):
    for _ in range(200): f()
    t0=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e6
print("plain gqa", t(lambda: F.scaled_dot_product_attention(q,k,v,enable_gqa=True,scale=0.125)))
print("plain folded", t(lambda: F.scaled_dot_product_attention(q.reshape(b,hkv,3,d),k,v,scale=0.125)))
print("corrected_sdpa", t(lambda: corrected_sdpa(q,k,v,bias,0.125)))
def fast():
    m = F.pad(bias,(0,new)).unsqueeze(2)
    return F.scaled_dot_product_attention(q.reshape(b,hkv,3,d),k,v,attn_mask=m,scale=0.125).view(b,hq,1,d).transpose(1,2).contiguous()
print("fast pad", t(fast))
m0 = F.pad(bias,(0,new)).unsqueeze(2)
print("sdpa w/ premade mask", t(lambda: F.scaled_dot_product_attention(q.reshape(b,hkv,3,d),k,v,attn_mask=m0,scale=0.125)))
m1 = m0.expand(b,hkv,3,S+new)
print("sdpa w/ expanded mask", t(lambda: F.scaled_dot_product_attention(q.reshape(b,hkv,3,d),k,v,attn_mask=m1,scale=0.125)))
m2 = m1.contiguous()
print("sdpa w/ contiguous mask", t(lambda: F.scaled_dot_product_attention(q.reshape(b,hkv,3,d),k,v,attn_mask=m2,scale=0.125)))
def manual():
    s = torch.matmul(q.reshape(b,hkv,3,d), k.transpose(2,3)).mul_(0.125)
    s[..., :S] += bias[:,:,None]
    return torch.matmul(torch.softmax(s,-1), v)
print("manual", t(manual))
