// meshmem-info: what meshmem finds on this machine, and what it would do in this job.
// See usage() below. One process per node (the lowest rank of each) checks its node; rank 0
// prints every node's report, and with --job the transport of every pair of ranks and why.
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#include "info/json_writer.hpp"
#include "info/node_report.hpp"

namespace {

using meshmem::info::JsonWriter;
using meshmem::info::NodeReport;

void usage(std::FILE* to) {
  std::fprintf(to,
               "usage: meshmem-info [--json] [--all] [--bandwidth]    this machine: GPUs (PCI, NUMA, CPUs), peer access\n"
               "                                                     with write-and-verify and the reason for every\n"
               "                                                     missing or broken pair, VMM / POSIX-fd / host-NUMA\n"
               "                                                     support, descriptor passing, MPI, NCCL; the settings\n"
               "       mpirun -np N meshmem-info --job [--json]      the same for every node of the job, then the\n"
               "                                                     transport of every pair of ranks, and why\n"
               "       meshmem-info --knobs-markdown[=all]           the MESHMEM_* settings as Markdown: the user\n"
               "                                                     settings (README.md), or all (docs/configuration.md)\n"
               "options:\n"
               "  --json       one JSON document on stdout, for scripts (every setting, with its tier and source)\n"
               "  --all        list every setting (tuning and testing ones too), not only the user settings\n"
               "  --bandwidth  also time peer copies between every pair of GPUs and pinned host copies\n"
               "  --job        build a meshmem Comm over MPI_COMM_WORLD and report its routes\n"
               "exit code: 0 fine; 1 an error (the message says which); 2 bad arguments; 3 the job cannot run\n"
               "as asked (a pair of ranks with no transport, or a GPU pair whose peer access is granted but broken)\n");
}

using Setting = meshmem::Options::Setting;
const char* const kTiers[] = {"user", "tuning", "testing"};

void print_table(const std::vector<Setting>& settings, const char* tier, bool old_names) {
  std::printf("| variable | default | meaning |\n| --- | --- | --- |\n");
  for (const Setting& s : settings) {
    if (s.tier != tier) continue;
    const std::string was = old_names && !s.old_name.empty() ? " (was `" + s.old_name + "`)" : "";
    std::printf("| `%s` | `%s` | %s%s |\n", s.name.c_str(), s.default_value.c_str(), s.doc.c_str(), was.c_str());
  }
}

// The README's table ("## Configuration": the user settings) and docs/configuration.md's
// generated part (every tier, then the details), made from the knob table through
// Options::settings(), so that the docs cannot drift from the code (tests/docs check both).
void print_knob_markdown(bool all) {
  const std::vector<Setting> settings = meshmem::Options{}.settings();
  if (!all) {
    print_table(settings, "user", false);
    return;
  }
  const char* const titles[] = {"User settings", "Tuning settings", "Testing settings"};
  const char* const intros[] = {
      "What a user may need to set. Every rank must have the same value, except where the meaning says not.",
      "meshmem's internals: thresholds, variants and their measurements. The defaults are what was measured best.",
      "For meshmem's own tests: faults, simulated placements, paths broken on purpose. Not for production runs."};
  for (int t = 0; t < 3; ++t) {
    std::printf("%s## %s\n\n%s\n\n", t ? "\n" : "", titles[t], intros[t]);
    print_table(settings, kTiers[t], true);
  }
  std::printf("\n## Details\n");
  for (const Setting& s : settings) {
    if (s.details.empty() && s.must_agree) continue;
    std::printf("\n### `%s`\n\n", s.name.c_str());
    if (!s.details.empty()) std::printf("%s.\n", s.details.c_str());
    if (!s.must_agree) std::printf("%sMay differ between ranks.\n", s.details.empty() ? "" : "\n");
  }
}

// "NAME=value" lines of the settings of one tier (or all), marking those not at their default.
void print_settings(const std::vector<Setting>& settings, bool all) {
  std::size_t others = 0;
  for (const char* tier : kTiers) {
    bool first = true;
    for (const Setting& s : settings) {
      if (s.tier != tier) continue;
      if (!all && s.tier != std::string("user")) {
        ++others;
        continue;
      }
      if (first) std::printf("%s settings:\n", tier);
      first = false;
      std::string note = s.source == "default" ? "" : "  [" + s.source + "]";
      if (!s.used) note += "  [unused: no GPU part]";
      std::printf("  %s=%s%s\n", s.name.c_str(), s.value.c_str(), note.c_str());
    }
  }
  std::size_t changed = 0;
  for (const Setting& s : settings)
    if (!all && s.tier != std::string("user") && s.source != "default") ++changed;
  if (others > 0)
    std::printf("  (%zu tuning and testing settings%s: meshmem-info --all; docs/configuration.md says what each means)\n",
                others, changed > 0 ? (", " + std::to_string(changed) + " of them set").c_str() : "");
}

void json_settings(JsonWriter& w, const meshmem::Options& options) {
  w.key("settings").begin_object();
  for (const Setting& s : options.settings()) {
    w.key(s.name).begin_object().field("value", s.value).field("default", s.default_value).field("tier", s.tier);
    w.field("source", s.source).field("used", s.used);
    if (!s.old_name.empty()) w.field("old_name", s.old_name);
    w.end_object();
  }
  w.end_object();
  w.key("notices").begin_array();
  for (const std::string& n : options.notices()) w.value(n);
  w.end_array();
}

// Every rank's string, in rank order, on rank 0 (empty elsewhere).
std::vector<std::string> gather_strings(const std::string& mine, MPI_Comm comm) {
  int me = 0, n = 0;
  MPI_Comm_rank(comm, &me);
  MPI_Comm_size(comm, &n);
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(static_cast<std::size_t>(n)), displs(static_cast<std::size_t>(n));
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    displs[static_cast<std::size_t>(r)] = total;
    total += lens[static_cast<std::size_t>(r)];
  }
  std::vector<char> all(static_cast<std::size_t>(me == 0 ? total + 1 : 1));
  MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, comm);
  std::vector<std::string> out;
  if (me == 0)
    for (int r = 0; r < n; ++r)
      out.emplace_back(all.data() + displs[static_cast<std::size_t>(r)], static_cast<std::size_t>(lens[static_cast<std::size_t>(r)]));
  return out;
}

// Why a pair uses the transport it does, in words, for the --job table.
std::string why_this_transport(meshmem::TransportKind k) {
  switch (k) {
    case meshmem::TransportKind::Ipc: return "same node; each GPU maps the other's memory";
    case meshmem::TransportKind::Staged: return "same node; staged through the node's pinned host memory";
    case meshmem::TransportKind::Shm: return "same node; the window's shared memory is mapped here";
    case meshmem::TransportKind::Mpi: return "requests served by the target's progress thread over MPI";
    case meshmem::TransportKind::Nccl: return "other node; NCCL transfers driven by each rank's proxy thread";
    case meshmem::TransportKind::MpiDevice:
      return "other node; MPI messages through pinned host memory, driven by each rank's proxy thread";
    case meshmem::TransportKind::None: return "no transport reaches it";
  }
  return "";
}

struct JobRow {
  std::string text;
  std::string json;
  bool unreachable = false;
};

// This rank's routes to every rank, both memory kinds: in text a row of transports per
// kind, then the reasons (transports passed over, or why none reaches a rank).
JobRow job_row(const meshmem::Comm& comm, const std::string& host) {
  JobRow row;
  const bool device = comm.device_info().rfind("none", 0) != 0;
  // Without device windows the Comm's reason is the job's (it names the first rank that has
  // no GPU, the same on every rank): this rank's row says its own reason instead.
  std::string device_text = comm.device_info();
  std::string own;
  if (!device)
    device_text = meshmem::gpu_available(&own) ? "none: this rank has a GPU, but not every rank of the job (" +
                                                     device_text.substr(6) + ")"
                                               : "none: " + own;
  JsonWriter w;
  // "hostname" and "device_info": "host" and "device" are the routes' arrays below.
  w.begin_object().field("rank", comm.rank()).field("hostname", host).field("node", comm.node());
  w.field("device_info", device_text);
  std::string text = "rank " + std::to_string(comm.rank()) + " (" + host + ", node " + std::to_string(comm.node()) +
                     "): " + device_text + "\n";
  std::string reasons;
  for (meshmem::Memory memory : {meshmem::Memory::Host, meshmem::Memory::Device}) {
    const std::string mem = meshmem::to_string(memory);
    w.key(mem).begin_array();
    text += "  " + std::string(memory == meshmem::Memory::Host ? "host windows:  " : "device windows:");
    if (memory == meshmem::Memory::Device && !device) {
      text += " unavailable (above: why)\n";
      w.end_array();
      continue;
    }
    for (int r = 0; r < comm.size(); ++r) {
      const meshmem::TransportKind k = comm.transport(r, memory);
      const std::string skipped = comm.skipped_reason(r, memory);
      const bool none = k == meshmem::TransportKind::None;
      row.unreachable = row.unreachable || none;
      char cell[16];
      std::snprintf(cell, sizeof cell, " %-6s", meshmem::to_string(k));
      text += cell;
      if (!skipped.empty())
        reasons += "    " + mem + " -> rank " + std::to_string(r) + (none ? ": no transport: " : " (" + std::string(meshmem::to_string(k)) + "), passed over: ") + skipped + "\n";
      w.begin_object().field("to", r).field("transport", meshmem::to_string(k)).field("why", why_this_transport(k));
      if (!skipped.empty()) w.field(none ? "reasons" : "passed_over", skipped);
      w.end_object();
    }
    text += "\n";
    w.end_array();
  }
  w.end_object();
  row.text = text + reasons;
  row.json = w.str();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false, job = false, bandwidth = false, all = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--knobs-markdown" || a == "--knobs-markdown=all") {
      print_knob_markdown(a != "--knobs-markdown");
      return 0;
    }
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a == "--json") {
      json = true;
    } else if (a == "--job") {
      job = true;
    } else if (a == "--bandwidth") {
      bandwidth = true;
    } else if (a == "--all") {
      all = true;
    } else {
      std::fprintf(stderr, "meshmem-info: unknown argument %s\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int rc = 0;
  try {
    const meshmem::Options options = meshmem::Options::from_environment();  // a bad MESHMEM_* value: exit 1
    // Without --job no Comm reports them (a Comm does: once, on its rank 0, naming the ranks).
    if (!job && me == 0)
      for (const std::string& notice : options.notices()) std::fprintf(stderr, "meshmem-info: warning: %s\n", notice.c_str());

    // One report per node, made by its lowest rank before anything else touches the GPUs.
    const int node_rank = meshmem::node_local_rank(MPI_COMM_WORLD);
    std::string node_text, node_json;
    int problems = 0;
    if (node_rank == 0) {
      NodeReport report;
      meshmem::info::collect_system_facts(&report);
      meshmem::info::collect_gpu_facts(&report, bandwidth);
      node_text = report.text();
      JsonWriter w;
      report.json(w);
      node_json = w.str();
      problems = static_cast<int>(report.problems().size());
    }
    const std::vector<std::string> nodes = gather_strings(json ? node_json : node_text, MPI_COMM_WORLD);
    int all_problems = 0;
    MPI_Allreduce(&problems, &all_problems, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);

    std::vector<std::string> rows;
    int unreachable = 0;
    int node_count = 0;
    if (job) {
      meshmem::select_local_device(MPI_COMM_WORLD);  // one GPU per rank, as applications do
      meshmem::Comm comm(MPI_COMM_WORLD, options);
      node_count = comm.node_count();
      char host[256] = {};
      gethostname(host, sizeof host - 1);
      const JobRow row = job_row(comm, host);
      rows = gather_strings(json ? row.json : row.text, MPI_COMM_WORLD);
      int mine = row.unreachable ? 1 : 0;
      MPI_Allreduce(&mine, &unreachable, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
      if (me == 0 && !json) {
        std::printf("meshmem %s\n", "0.1.0");
        std::printf("job: %d rank(s) on %d node(s)%s; MPI thread level %s; fd passing %s\n", n, comm.node_count(),
                    comm.options().simulate_nodes > 1 ? " (simulated split)" : "",
                    provided >= MPI_THREAD_MULTIPLE ? "MPI_THREAD_MULTIPLE" : "below MPI_THREAD_MULTIPLE",
                    meshmem::to_string(comm.fd_passing()));
      }
    }
    if (me == 0) {
      if (json) {
        JsonWriter w;
        w.begin_object().field("meshmem", "0.1.0").field("ranks", n);
        json_settings(w, options);
        w.key("nodes").begin_array();
        for (const std::string& s : nodes)
          if (!s.empty()) w.raw(s);
        w.end_array();
        if (job) {
          w.field("node_count", node_count);
          w.key("pairs").begin_array();
          for (const std::string& s : rows) w.raw(s);
          w.end_array();
        }
        w.field("unreachable_pairs", unreachable > 0).field("broken_gpu_pairs", all_problems);
        w.end_object();
        std::printf("%s\n", w.str().c_str());
      } else {
        print_settings(options.settings(), all);
        for (const std::string& s : nodes) std::printf("%s", s.c_str());
        if (job) {
          std::printf("transports (row: from rank; column: to rank 0..%d; then the transports passed over and why)\n", n - 1);
          for (auto k : {meshmem::TransportKind::Ipc, meshmem::TransportKind::Staged, meshmem::TransportKind::Nccl,
                         meshmem::TransportKind::MpiDevice, meshmem::TransportKind::Shm, meshmem::TransportKind::Mpi, meshmem::TransportKind::None})
            std::printf("  %-10s %s\n", meshmem::to_string(k), why_this_transport(k).c_str());
          for (const std::string& s : rows) std::printf("%s", s.c_str());
        } else if (n == 1) {
          std::printf("run `mpirun -np N meshmem-info --job` to see the transport of every pair of ranks\n");
        }
        if (unreachable > 0) std::printf("some pairs of ranks have no transport (see above): the job cannot run as asked\n");
        if (all_problems > 0) std::printf("%d GPU pair(s) grant peer access that does not work (see above)\n", all_problems);
      }
      std::fflush(stdout);
    }
    if (unreachable > 0 || all_problems > 0) rc = 3;
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "meshmem-info: rank %d: %s\n", me, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
