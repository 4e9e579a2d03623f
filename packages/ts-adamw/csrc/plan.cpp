#include "plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "ts/errors.h"
#include "ts/ndarray.h"

namespace ts_adamw {

int64_t Plan::total() const {
    int64_t n = 0;
    for (const Segment& s : segments) n += s.n;
    return n;
}

Kind kind_of(const AnyArray& array) {
    switch (ts::scalar_kind(array.dtype())) {
        case ts::ScalarKind::float32: return Kind::f32;
        case ts::ScalarKind::bfloat16: return Kind::bf16;
        case ts::ScalarKind::float16: return Kind::f16;
        default: return Kind::none;
    }
}

const char* kind_name(Kind kind) {
    switch (kind) {
        case Kind::f32: return "float32";
        case Kind::bf16: return "bfloat16";
        case Kind::f16: return "float16";
        default: return "an unsupported dtype";
    }
}

void assign_offsets(const char* fn, std::vector<Segment>& segments, const std::vector<int64_t>& offsets) {
    if (offsets.empty()) return;
    TS_CHECK_ARG(offsets.size() == segments.size(), fn, ": offsets has ", offsets.size(), " entries for ",
                 segments.size(), " tensors; pass one per tensor or None");
    for (size_t i = 0; i < offsets.size(); ++i)
        TS_CHECK_ARG(offsets[i] >= 0 && offsets[i] <= kMaxFirstIndex, fn, ": offsets[", i, "]=", offsets[i],
                     " must be from 0 to 2**62");
    for (size_t i = 0; i < offsets.size(); ++i) segments[i].first_index = offsets[i];
}

size_t kind_bytes(Kind kind) { return kind == Kind::f32 ? 4 : (kind == Kind::none ? 0 : 2); }

Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                 bool maximize, double grad_scale, uint64_t seed) {
    // Same roundings as torch: Python doubles, cast to fp32 when they meet a tensor.
    const double bc1 = 1.0 - std::pow(beta1, double(step));
    const double bc2 = 1.0 - std::pow(beta2, double(step));
    Hyper h;
    h.decay = float(1.0 - lr * weight_decay);
    h.w1 = float(1.0 - beta1);
    h.lerp_small = h.w1 < 0.5f;
    h.lerp_coeff = h.lerp_small ? h.w1 : -(1.0f - h.w1);  // 1 - w1 is exact for w1 in [0.5, 1]
    h.beta2 = float(beta2);
    h.w2 = float(1.0 - beta2);
    h.bc2_sqrt = float(std::pow(bc2, 0.5));
    h.eps = float(eps);
    h.neg_step_size = float(-(lr / bc1));
    h.grad_scale = float(maximize ? -grad_scale : grad_scale);
    const uint32_t s_lo = uint32_t(seed), s_hi = uint32_t(seed >> 32);
    const uint32_t t_lo = uint32_t(step), t_hi = uint32_t(uint64_t(step) >> 32);
    h.seed_key = mix32(s_lo ^ mix32(s_hi ^ mix32(t_lo ^ mix32(t_hi + 0x2545f491u))));
    return h;
}

namespace {

void check_args(const char* fn, const StepArgs& a) {
    TS_CHECK_ARG(std::isfinite(a.lr) && a.lr >= 0, fn, ": lr=", a.lr, " must be a finite number >= 0");
    TS_CHECK_ARG(a.beta1 >= 0 && a.beta1 < 1, fn, ": beta1=", a.beta1, " must be in [0, 1)");
    TS_CHECK_ARG(a.beta2 >= 0 && a.beta2 < 1, fn, ": beta2=", a.beta2, " must be in [0, 1)");
    TS_CHECK_ARG(std::isfinite(a.eps) && a.eps >= 0, fn, ": eps=", a.eps, " must be a finite number >= 0");
    TS_CHECK_ARG(std::isfinite(a.weight_decay) && a.weight_decay >= 0, fn, ": weight_decay=", a.weight_decay,
                 " must be a finite number >= 0");
    TS_CHECK_ARG(a.step >= 1, fn, ": step=", a.step, " must be >= 1 (the count including this step)");
    TS_CHECK_ARG(std::isfinite(a.grad_scale), fn, ": grad_scale=", a.grad_scale, " must be finite");
}

std::string item(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

void check_tensor(const char* fn, const AnyArray& a, const std::string& what, int64_t numel) {
    TS_CHECK_ARG(ts::is_contiguous(a), fn, ": ", what, " must be contiguous; call .contiguous() on it first");
    TS_CHECK_ARG(int64_t(a.size()) == numel, fn, ": ", what, " has ", a.size(), " elements but the parameter has ",
                 numel, " (shapes may differ, element counts must match)");
}

// One tensor's bytes, for the aliasing check.
struct Span {
    uintptr_t begin, end;
    bool written;
    size_t index;
    const char* list;  // "params", ...
    const char* one;   // "param", ...: the name in a one-tensor call
};

// Refuses any two buffers that share a byte when at least one of them is
// written (param, moments, param_out): the kernels read and write each
// element once, so aliased buffers would give a silently wrong update.
// Gradients may share memory with each other (they are only read).
void check_no_alias(const char* fn, const Plan& plan, size_t count) {
    std::vector<Span> spans;
    spans.reserve(plan.segments.size() * 5);
    const size_t mb = kind_bytes(plan.moment_kind);
    for (size_t i = 0; i < plan.segments.size(); ++i) {
        const Segment& s = plan.segments[i];
        if (s.n == 0) continue;
        auto add = [&](const void* ptr, size_t bytes, bool written, const char* list, const char* one) {
            const auto begin = reinterpret_cast<uintptr_t>(ptr);
            spans.push_back({begin, begin + bytes * size_t(s.n), written, i, list, one});
        };
        add(s.param, 4, true, "params", "param");
        if (s.grad != nullptr) add(s.grad, kind_bytes(s.grad_kind), false, "grads", "grad");
        add(s.exp_avg, mb, true, "exp_avgs", "exp_avg");
        add(s.exp_avg_sq, mb, true, "exp_avg_sqs", "exp_avg_sq");
        if (s.out != nullptr) add(s.out, kind_bytes(s.out_kind), true, "params_out", "param_out");
    }
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    auto name = [&](const Span& s) {
        return count == 1 ? std::string(s.one) : std::string(s.list) + "[" + std::to_string(s.index) + "]";
    };
    // Sweep by start: a span overlaps an earlier one iff it starts before the
    // furthest end seen so far (of any span when it is written, of a written
    // span when it is only read).
    const Span* far_any = nullptr;
    const Span* far_written = nullptr;
    for (const Span& s : spans) {
        const Span* hit = s.written ? far_any : far_written;
        if (hit != nullptr && s.begin < hit->end) {
            const uintptr_t bytes = std::min(s.end, hit->end) - s.begin;
            ts::throw_value_error(fn, ": ", name(*hit), " and ", name(s), " share memory (", bytes,
                                  " bytes overlap); pass distinct buffers (clone() one of them)");
        }
        if (far_any == nullptr || s.end > far_any->end) far_any = &s;
        if (s.written && (far_written == nullptr || s.end > far_written->end)) far_written = &s;
    }
}

}  // namespace

namespace {

// Checks one parameter's state tensors and places them; the gradient is left out (nullptr).
Segment state_segment(const char* fn, size_t i, const AnyArray& p, const AnyArray& m, const AnyArray& v,
                      const AnyArray* out, const PlaceFn& place, Kind& moment_kind) {
    const std::string p_name = item("params", i), m_name = item("exp_avgs", i), v_name = item("exp_avg_sqs", i);
    TS_CHECK_ARG(kind_of(p) == Kind::f32, fn, ": ", p_name, " is ", kind_name(kind_of(p)),
                 "; parameters (master weights) must be float32");
    const int64_t n = int64_t(p.size());
    check_tensor(fn, p, p_name, n);
    Kind mk = kind_of(m), vk = kind_of(v);
    TS_CHECK_ARG((mk == Kind::f32 || mk == Kind::bf16) && mk == vk, fn, ": ", m_name, " is ", kind_name(mk),
                 " and ", v_name, " is ", kind_name(vk), "; moments must be both float32 or both bfloat16");
    if (i == 0) moment_kind = mk;
    TS_CHECK_ARG(mk == moment_kind, fn, ": ", m_name, " is ", kind_name(mk), " but exp_avgs[0] is ",
                 kind_name(moment_kind), "; one call takes one moment dtype");
    check_tensor(fn, m, m_name, n);
    check_tensor(fn, v, v_name, n);
    Segment s{};
    s.n = n;
    s.grad = nullptr;
    s.grad_kind = Kind::none;
    s.param = static_cast<float*>(place(p, p_name.c_str()));
    s.exp_avg = place(m, m_name.c_str());
    s.exp_avg_sq = place(v, v_name.c_str());
    s.out_kind = Kind::none;
    s.out = nullptr;
    if (out != nullptr) {
        const std::string o_name = item("params_out", i);
        s.out_kind = kind_of(*out);
        TS_CHECK_ARG(s.out_kind != Kind::none, fn, ": ", o_name, " is ", kind_name(s.out_kind),
                     "; params_out must be bfloat16, float16 or float32");
        check_tensor(fn, *out, o_name, n);
        s.out = place(*out, o_name.c_str());
    }
    return s;
}

void check_counts(const char* fn, size_t count, size_t ms, size_t vs, size_t outs, size_t slots) {
    TS_CHECK_ARG(ms == count && vs == count, fn, ": got ", count, " params, ", ms, " exp_avgs and ", vs,
                 " exp_avg_sqs; pass one of each per parameter");
    TS_CHECK_ARG(outs == 0 || outs == count, fn, ": params_out has ", outs, " tensors for ", count,
                 " params; pass one per parameter or None");
    TS_CHECK_ARG(slots == 0 || slots == count, fn, ": slots has ", slots, " entries for ", count, " params");
}

void assign_keys(Plan& plan, const std::vector<uint32_t>& slots) {
    for (size_t i = 0; i < plan.segments.size(); ++i)
        plan.segments[i].key = tensor_key(plan.hyper.seed_key, slots.empty() ? uint32_t(i) : slots[i]);
}

}  // namespace

Plan build_plan(const char* fn, const std::vector<AnyArray>& params, const std::vector<AnyArray>& grads,
                const std::vector<AnyArray>& exp_avgs, const std::vector<AnyArray>& exp_avg_sqs,
                const std::vector<AnyArray>& outs, const std::vector<uint32_t>& slots, const StepArgs& args,
                const PlaceFn& place) {
    check_args(fn, args);
    const size_t count = params.size();
    TS_CHECK_ARG(grads.size() == count, fn, ": got ", count, " params and ", grads.size(),
                 " grads; pass one of each per parameter");
    check_counts(fn, count, exp_avgs.size(), exp_avg_sqs.size(), outs.size(), slots.size());
    Plan plan;
    plan.hyper = make_hyper(args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, args.step,
                            args.maximize, args.grad_scale, args.seed);
    plan.segments.reserve(count);
    for (size_t i = 0; i < count; ++i) {
        Segment s = state_segment(fn, i, params[i], exp_avgs[i], exp_avg_sqs[i], outs.empty() ? nullptr : &outs[i],
                                  place, plan.moment_kind);
        const std::string g_name = item("grads", i);
        s.grad_kind = kind_of(grads[i]);
        TS_CHECK_ARG(s.grad_kind != Kind::none, fn, ": ", g_name, " is ", kind_name(s.grad_kind),
                     "; gradients must be float32, bfloat16 or float16");
        check_tensor(fn, grads[i], g_name, s.n);
        s.grad = place(grads[i], g_name.c_str());
        plan.segments.push_back(s);
    }
    assign_keys(plan, slots);
    check_no_alias(fn, plan, count);
    return plan;
}

PreparedPlan prepare_plan(const char* fn, const std::vector<AnyArray>& params, const std::vector<AnyArray>& exp_avgs,
                          const std::vector<AnyArray>& exp_avg_sqs, const std::vector<AnyArray>& outs,
                          const std::vector<uint32_t>& slots, const std::vector<int>& grad_kinds,
                          const PlaceFn& place) {
    const size_t count = params.size();
    check_counts(fn, count, exp_avgs.size(), exp_avg_sqs.size(), outs.size(), slots.size());
    TS_CHECK_ARG(grad_kinds.size() == count, fn, ": ", grad_kinds.size(), " gradient dtypes for ", count,
                 " params");
    PreparedPlan prepared;
    prepared.slots = slots;
    prepared.plan.segments.reserve(count);
    for (size_t i = 0; i < count; ++i) {
        const Kind gk = Kind(grad_kinds[i]);
        TS_CHECK_ARG(gk == Kind::f32 || gk == Kind::bf16 || gk == Kind::f16, fn, ": the gradient dtype of params[",
                     i, "] must be float32, bfloat16 or float16");
        prepared.grad_kinds.push_back(gk);
        prepared.plan.segments.push_back(state_segment(fn, i, params[i], exp_avgs[i], exp_avg_sqs[i],
                                                       outs.empty() ? nullptr : &outs[i], place,
                                                       prepared.plan.moment_kind));
    }
    check_no_alias(fn, prepared.plan, count);  // the written buffers among themselves (no gradients yet)
    const size_t mb = kind_bytes(prepared.plan.moment_kind);
    for (const Segment& s : prepared.plan.segments) {
        if (s.n == 0) continue;
        auto add = [&](const void* ptr, size_t bytes) {
            const auto begin = reinterpret_cast<uintptr_t>(ptr);
            prepared.written.emplace_back(begin, begin + bytes * size_t(s.n));
        };
        add(s.param, 4);
        add(s.exp_avg, mb);
        add(s.exp_avg_sq, mb);
        if (s.out != nullptr) add(s.out, kind_bytes(s.out_kind));
    }
    std::sort(prepared.written.begin(), prepared.written.end());
    return prepared;
}

Plan PreparedPlan::with_grads(const char* fn, const std::vector<uintptr_t>& grads, const StepArgs& args) const {
    check_args(fn, args);
    TS_CHECK_ARG(grads.size() == plan.segments.size(), fn, ": got ", grads.size(), " gradients for ",
                 plan.segments.size(), " prepared parameters");
    Plan out = plan;
    out.hyper = make_hyper(args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, args.step, args.maximize,
                           args.grad_scale, args.seed);
    for (size_t i = 0; i < grads.size(); ++i) {
        Segment& s = out.segments[i];
        s.grad_kind = grad_kinds[i];
        s.grad = reinterpret_cast<const void*>(grads[i]);
        if (s.n == 0) continue;
        const size_t bytes = kind_bytes(s.grad_kind);
        TS_CHECK_ARG(grads[i] != 0 && grads[i] % bytes == 0, fn, ": grads[", i, "] is not a valid address of ",
                     kind_name(s.grad_kind), " elements");
        const uintptr_t begin = grads[i], end = begin + bytes * size_t(s.n);
        // The first written range ending after `begin` is the only one that can overlap it (disjoint, sorted).
        auto hit = std::upper_bound(written.begin(), written.end(), begin,
                                    [](uintptr_t value, const std::pair<uintptr_t, uintptr_t>& r) {
                                        return value < r.second;
                                    });
        TS_CHECK_ARG(hit == written.end() || hit->first >= end, fn, ": grads[", i,
                     "] shares memory with a master weight, moment or params_out buffer of this batch; pass a "
                     "distinct gradient buffer");
    }
    assign_keys(out, slots);
    return out;
}

}  // namespace ts_adamw
