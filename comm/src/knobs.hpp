// The knob table: every MESHMEM_* variable is declared once, beside the code that uses it,
// as a Knob object with its tier, name (and the name it had before, if any), default, a one-line
// doc, a longer explanation for docs/configuration.md, whether every rank must agree on it, and
// its parser. Options::parse, Options::settings (meshmem-info), the cross-rank fingerprint, the
// README's table and docs/configuration.md (meshmem-info --knobs-markdown[=all]) read this table.
//
//   // in transport_foo.cpp (or, for the GPU part, a CUDA-free foo_knobs.hpp beside it):
//   const TuningKnob<std::size_t> kChunk{Tier::Tuning, "foo", "MESHMEM_FOO_CHUNK", 1 << 20, parse_bytes,
//                                        print_number, "foo transport: bytes per pipeline chunk", nullptr};
//   ... kChunk.get(options) ...
//
// CUDA-free and MPI-free.
#pragma once

#include <chrono>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "meshmem/config.hpp"

namespace meshmem::detail {

// Who a knob is for: User (the README lists these, at most 10), Tuning (meshmem's internals:
// meshmem-info --all, docs/configuration.md), Testing (for meshmem's own tests: faults,
// simulated placements, deliberately broken paths).
enum class Tier { User, Tuning, Testing };
const char* to_string(Tier tier) noexcept;  // "user", "tuning", "testing"

// A knob's variable, and the name it had before a rename: the old name is still read for one
// release, with a warning naming the new one.
struct KnobName {
  KnobName(const char* n) : name(n) {}  // NOLINT(google-explicit-constructor): a plain name
  KnobName(const char* n, const char* old) : name(n), old_name(old) {}
  const char* name;
  const char* old_name = nullptr;
};

class Knob {
 public:
  // Adds the knob to the table. `group`: "core" (config.cpp only) or the part that declares
  // it ("ipc", "staged", "mpi", ...); the GPU part's groups are listed in knobs.cpp
  // (kGpuGroups). `doc`: one line (at most 160 characters); `details`: the rest, or nullptr.
  // Knobs are namespace-scope objects.
  Knob(Tier tier, const char* group, KnobName name, const char* doc, const char* details, bool must_agree);
  Knob(const Knob&) = delete;
  Knob& operator=(const Knob&) = delete;
  virtual ~Knob() = default;

  Tier tier() const { return tier_; }
  const char* group() const { return group_; }
  const char* name() const { return name_.name; }
  const char* old_name() const { return name_.old_name; }  // nullptr: never renamed
  const char* doc() const { return doc_; }
  const char* details() const { return details_ == nullptr ? "" : details_; }
  // Ranks that differ in this knob would choose different routes or protocols for one pair.
  bool must_agree() const { return must_agree_; }
  // Read by the GPU part's code (in the table of every build, so that its values are checked
  // everywhere; without the GPU part they have no effect).
  bool in_gpu_part() const;

  // Checks `raw` and stores it in `o`; raises Error(InvalidArgument) naming the variable.
  virtual void set(Options& o, const std::string& raw) const = 0;
  // The value `o` holds, in canonical text ("auto", "8192", "5000ms").
  virtual std::string text(const Options& o) const = 0;
  virtual std::string default_text() const = 0;

 private:
  Tier tier_;
  const char* group_;
  KnobName name_;
  const char* doc_;
  const char* details_;
  bool must_agree_;
};

// Every knob of the table: the core's in declaration order, then by group and name. The GPU
// part's knobs are declared in CUDA-free headers beside its code, included by knobs.cpp too, so
// that every build has them all (a build or program without the GPU part checks their values
// and reports them unused). Any other knob is in the table when its object file is linked:
// declare it in the file of the code that reads it (a transport's file is linked through the
// transport table).
std::vector<const Knob*> knob_table();
// By its name, or else by its old name (*old set to true then, where given).
const Knob* find_knob(const std::string& name, bool* old = nullptr);

// MESHMEM_* variables that are not knobs and are never warned of (docs/configuration.md):
// those of meshmem's tests (MESHMEM_TEST_*, MESHMEM_SOAK_*), of its launch tools
// (MESHMEM_HOSTS_*) and of its build (MESHMEM_BUILD_*, MESHMEM_ENABLE_*, ...).
bool exempt_variable(const std::string& name);
// The knob whose name (or old name) is nearest to `name` by edit distance (letters inserted,
// removed, replaced or two swapped), if near enough to be a misspelling; else nullptr.
const Knob* closest_knob(const std::string& name);
// The warning for a MESHMEM_* variable that is neither a knob nor exempt ("" for those).
std::string unknown_variable_notice(const std::string& name);
// The warning for a knob read by its old name (it names the new one).
std::string old_name_notice(const Knob& k);
// Whether this program has the GPU part linked (else the GPU part's knobs are unused).
bool gpu_part_linked();

template <class T>
using KnobParser = T (*)(const char* name, const std::string& raw);
template <class T>
using KnobPrinter = std::string (*)(const T& value);

// A knob users set through the public Options (a field of it).
template <class T>
class OptionKnob final : public Knob {
 public:
  OptionKnob(Tier tier, KnobName name, T Options::*field, KnobParser<T> parse, KnobPrinter<T> print, const char* doc,
             const char* details, bool must_agree = true)
      : Knob(tier, "core", name, doc, details, must_agree), field_(field), parse_(parse), print_(print) {}
  void set(Options& o, const std::string& raw) const override { o.*field_ = parse_(name(), raw); }
  std::string text(const Options& o) const override { return print_(o.*field_); }
  std::string default_text() const override { return print_(Options{}.*field_); }

 private:
  T Options::*field_;
  KnobParser<T> parse_;
  KnobPrinter<T> print_;
};

// A transport's tuning knob: kept as text in Options (Options::set), read with get().
template <class T>
class TuningKnob final : public Knob {
 public:
  TuningKnob(Tier tier, const char* group, KnobName name, T def, KnobParser<T> parse, KnobPrinter<T> print,
             const char* doc, const char* details, bool must_agree = true)
      : Knob(tier, group, name, doc, details, must_agree), def_(std::move(def)), parse_(parse), print_(print) {}
  T get(const Options& o) const {
    const auto it = o.tuning().find(name());
    return it == o.tuning().end() ? def_ : parse_(name(), it->second);
  }
  void set(Options& o, const std::string& raw) const override { o.tuning_[name()] = print_(parse_(name(), raw)); }
  std::string text(const Options& o) const override { return print_(get(o)); }
  std::string default_text() const override { return print_(def_); }

 private:
  T def_;
  KnobParser<T> parse_;
  KnobPrinter<T> print_;
};

// ---- parsers and printers shared by the knobs ----
[[noreturn]] void bad_knob_value(const char* name, const std::string& raw, const std::string& expected);
std::string lower_trimmed(const std::string& s);
std::size_t parse_bytes(const char* name, const std::string& raw);  // a byte count up to 2^40
std::string print_number(const std::size_t& n);
// A short time with its unit: "250us", "2ms", or "0"; at most `max`.
std::chrono::microseconds parse_micros(const char* name, const std::string& raw, std::chrono::microseconds max);
std::string print_micros(const std::chrono::microseconds& t);  // "0", "250us", "2ms"

// Enumerated knobs: a table of names, the first name of a value being the one printed.
//   constexpr std::pair<const char*, Mode> kModes[] = {{"auto", Mode::Auto}, {"fast", Mode::Fast}};
//   const TuningKnob<Mode> kMode{Tier::Tuning, "foo", "MESHMEM_FOO_MODE", Mode::Auto, parse_named<kModes>,
//                                print_named<kModes>, "...", nullptr};
template <class E, std::size_t N>
E parse_choice(const char* name, const std::string& raw, const std::pair<const char*, E> (&names)[N]) {
  const std::string m = lower_trimmed(raw);
  std::string all;
  for (const auto& [text, value] : names) {
    if (m == text) return value;
    all += (all.empty() ? "" : ", ") + std::string(text);
  }
  bad_knob_value(name, raw, "one of " + all);
}
template <class E, std::size_t N>
std::string choice_name(const E& v, const std::pair<const char*, E> (&names)[N]) {
  for (const auto& [text, value] : names)
    if (value == v) return text;
  return "?";
}
// The parser and printer of a knob whose names are the table `Names` (a KnobParser / KnobPrinter).
template <const auto& Names>
auto parse_named(const char* name, const std::string& raw) {
  return parse_choice(name, raw, Names);
}
template <const auto& Names, class E>
std::string print_named(const E& v) {
  return choice_name(v, Names);
}

}  // namespace meshmem::detail
