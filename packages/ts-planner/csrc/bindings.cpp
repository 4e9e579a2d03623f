// Python bindings of ts_planner._core: the native probes.
#include <nanobind/nanobind.h>

#include "probes.h"
#include "ts/bindings.h"

namespace nb = nanobind;
using namespace ts_planner;

NB_MODULE(_core, m) {
    ts::register_common(m);
    m.def("host_copy_gbps", &host_copy_gbps, nb::arg("bytes"), nb::arg("threads") = 0, nb::arg("repeats") = 3,
          nb::call_guard<nb::gil_scoped_release>(),
          "Host memcpy rate in GB/s (read + written bytes), threaded, best of `repeats`.");
    m.def("link_gbps",
          [](size_t bytes, int device, int repeats) {
              LinkRates r;
              {
                  nb::gil_scoped_release release;
                  r = link_gbps(bytes, device, repeats);
              }
              nb::dict d;
              d["h2d_gbps"] = r.h2d_gbps;
              d["d2h_gbps"] = r.d2h_gbps;
              d["both_gbps"] = r.both_gbps;
              return d;
          },
          nb::arg("bytes"), nb::arg("device"), nb::arg("repeats") = 3,
          "Pinned host<->device copy rates in GB/s (alone each way, and both at once); synchronizes the device.");
}
