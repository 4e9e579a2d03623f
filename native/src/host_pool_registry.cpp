// Publishing and finding the process-wide host pool (ts/host_pool_abi.h).
// Runs at module init with the GIL held, which makes look-up-then-publish
// atomic across cores imported from several threads.
#include <Python.h>

#include <string>

#include "ts/errors.h"
#include "ts/thread_pool.h"

namespace ts {

std::string bind_process_host_pool(const char* module_name) {
    const ts_host_pool_api& own = local_host_pool_api(module_name);
    PyObject* existing = PySys_GetObject(TS_HOST_POOL_ATTR);  // borrowed; NULL without an error when absent
    if (existing == nullptr) {
        PyObject* capsule = PyCapsule_New(const_cast<ts_host_pool_api*>(&own), TS_HOST_POOL_CAPSULE, nullptr);
        const bool published = capsule != nullptr && PySys_SetObject(TS_HOST_POOL_ATTR, capsule) == 0;
        Py_XDECREF(capsule);
        use_host_pool_api(own);
        if (published) return "";
        PyErr_Clear();
        return concat(module_name, " could not publish its host thread pool on sys.", TS_HOST_POOL_ATTR,
                      "; other TrainStream cores will start their own threads");
    }
    if (!PyCapsule_IsValid(existing, TS_HOST_POOL_CAPSULE)) {
        use_host_pool_api(own);
        return concat("sys.", TS_HOST_POOL_ATTR, " is not a \"", TS_HOST_POOL_CAPSULE, "\" capsule; ", module_name,
                      " runs its own host thread pool (one more set of threads)");
    }
    auto* api = static_cast<const ts_host_pool_api*>(PyCapsule_GetPointer(existing, TS_HOST_POOL_CAPSULE));
    if (api == nullptr || api->abi_version != TS_HOST_POOL_ABI_VERSION || api->struct_size < sizeof(ts_host_pool_api)) {
        PyErr_Clear();
        use_host_pool_api(own);
        const char* provider = api != nullptr && api->abi_version == TS_HOST_POOL_ABI_VERSION ? api->provider
                                                                                                : "another core";
        return concat(module_name, " cannot share the host thread pool of ", provider, " (pool ABI version ",
                      api ? api->abi_version : 0, ", size ", api ? api->struct_size : 0, "; this core needs version ",
                      TS_HOST_POOL_ABI_VERSION, ", size >= ", sizeof(ts_host_pool_api),
                      "), so it runs its own pool; install TrainStream packages of one release");
    }
    use_host_pool_api(*api);
    return "";
}

}  // namespace ts
