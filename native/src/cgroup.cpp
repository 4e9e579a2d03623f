#include "ts/cgroup.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ts {

namespace {

bool is_dir(const std::string& path) {
    struct stat st{};
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string trim(const std::string& s) {
    const auto begin = s.find_first_not_of(" \t\r\n");
    if (begin == std::string::npos) return "";
    return s.substr(begin, s.find_last_not_of(" \t\r\n") - begin + 1);
}

// Strict non-negative integer ("max", "-1", garbage: false).
bool parse_u64(const std::string& text, uint64_t& value) {
    const std::string s = trim(text);
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return false;
    errno = 0;
    value = std::strtoull(s.c_str(), nullptr, 10);
    return errno == 0;
}

bool read_u64(const std::string& path, uint64_t& value) {
    std::string text;
    return read_file(path, text) && parse_u64(text, value);
}

// A key of memory.stat ("inactive_file 663552" lines).
bool stat_value(const std::string& path, const std::string& key, uint64_t& value) {
    std::ifstream in(path);
    std::string name;
    uint64_t v = 0;
    while (in >> name >> v) {
        if (name == key) {
            value = v;
            return true;
        }
    }
    return false;
}

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> parts;
    std::string part;
    std::istringstream in(s);
    while (std::getline(in, part, sep)) parts.push_back(part);
    return parts;
}

// base + path, then each parent up to base. A path that does not exist under
// base (a container shows the host's path but mounts its own cgroup as the
// root) leaves base alone.
std::vector<std::string> walk_up(const std::string& base, const std::string& path) {
    std::vector<std::string> parts;
    for (const std::string& p : split(path, '/'))
        if (!p.empty() && p != "." && p != "..") parts.push_back(p);
    std::string leaf = base;
    for (const std::string& p : parts) leaf += "/" + p;
    std::vector<std::string> dirs;
    if (!is_dir(leaf)) return {base};
    for (size_t keep = parts.size() + 1; keep-- > 0;) {
        std::string dir = base;
        for (size_t i = 0; i < keep; ++i) dir += "/" + parts[i];
        dirs.push_back(dir);
    }
    return dirs;
}

}  // namespace

std::string system_root(const std::string& root) {
    std::string r = root;
    if (r.empty()) {
        const char* env = std::getenv("TS_CGROUP_ROOT");
        if (env != nullptr) r = env;
    }
    while (!r.empty() && r.back() == '/') r.pop_back();
    return r;
}

bool read_file(const std::string& path, std::string& out) {
    std::ifstream in(path);
    if (!in) return false;
    std::ostringstream text;
    text << in.rdbuf();
    out = text.str();
    return true;
}

CgroupDirs cgroup_dirs(const std::string& root_arg, const std::string& controller) {
    const std::string root = system_root(root_arg);
    std::ifstream in(root + "/proc/self/cgroup");
    std::string line, v2_path, v1_path, v1_field;
    bool have_v2 = false, have_v1 = false;
    while (std::getline(in, line)) {
        // "hierarchy-id:controller,list:/path" (the path may itself hold ':').
        const auto a = line.find(':');
        const auto b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string id = line.substr(0, a), field = line.substr(a + 1, b - a - 1);
        const std::string path = trim(line.substr(b + 1));
        if (id == "0" && field.empty()) {
            have_v2 = true;
            v2_path = path;
            continue;
        }
        for (const std::string& c : split(field, ','))
            if (c == controller) {
                have_v1 = true;
                v1_path = path;
                v1_field = field;
            }
    }
    const std::string mount = root + "/sys/fs/cgroup";
    CgroupDirs out;
    if (have_v1) {  // v1 (or a hybrid host whose v1 hierarchy has this controller)
        for (const std::string& base : {mount + "/" + v1_field, mount + "/" + controller}) {
            if (is_dir(base)) {
                out.version = 1;
                out.dirs = walk_up(base, v1_path);
                return out;
            }
        }
    }
    if (have_v2) {
        for (const std::string& base : {mount, mount + "/unified"}) {
            std::string controllers;
            if (!read_file(base + "/cgroup.controllers", controllers)) continue;
            bool listed = false;
            for (const std::string& c : split(trim(controllers), ' ')) listed = listed || c == controller;
            if (!listed) continue;
            out.version = 2;
            out.dirs = walk_up(base, v2_path);
            return out;
        }
    }
    return out;
}

CgroupCpu cgroup_cpu_quota(const std::string& root) {
    CgroupCpu best;
    const CgroupDirs where = cgroup_dirs(root, "cpu");
    for (const std::string& dir : where.dirs) {
        uint64_t quota = 0, period = 0;
        if (where.version == 2) {
            std::string text;
            if (!read_file(dir + "/cpu.max", text)) continue;
            std::istringstream fields(text);
            std::string q, p;
            fields >> q >> p;  // "max 100000" or "150000 100000"
            if (!parse_u64(q, quota) || !parse_u64(p, period)) continue;
        } else {
            // cfs_quota_us is -1 without a quota: parse_u64 refuses it.
            if (!read_u64(dir + "/cpu.cfs_quota_us", quota) || !read_u64(dir + "/cpu.cfs_period_us", period))
                continue;
        }
        if (quota == 0 || period == 0) continue;
        const double cpus = double(quota) / double(period);
        if (best.version == 0 || cpus < best.cpus) {
            best.version = where.version;
            best.cpus = cpus;
            best.dir = dir;
        }
    }
    return best;
}

CgroupMemory cgroup_memory(const std::string& root) {
    CgroupMemory best;
    const CgroupDirs where = cgroup_dirs(root, "memory");
    // v1 reports "no limit" as a page-rounded LONG_MAX; anything that large is none.
    constexpr uint64_t kUnlimited = uint64_t(1) << 62;
    for (const std::string& dir : where.dirs) {
        uint64_t limit = 0, usage = 0, reclaimable = 0;
        const bool v2 = where.version == 2;
        if (!read_u64(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), limit) || limit >= kUnlimited) continue;
        if (!read_u64(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"), usage)) usage = 0;
        const std::string stat = dir + "/memory.stat";
        if (!(v2 ? stat_value(stat, "inactive_file", reclaimable)
                 : (stat_value(stat, "total_inactive_file", reclaimable) ||
                    stat_value(stat, "inactive_file", reclaimable))))
            reclaimable = 0;
        reclaimable = std::min(reclaimable, usage);
        const uint64_t used = usage - reclaimable;
        const uint64_t room = limit > used ? limit - used : 0;
        if (best.version == 0 || room < best.room) {
            best.version = where.version;
            best.limit = limit;
            best.usage = usage;
            best.reclaimable = reclaimable;
            best.room = room;
            best.dir = dir;
        }
    }
    return best;
}

}  // namespace ts
