// The knob table: every MESHMEM_* variable is declared once, beside the code that uses it,
// as a Knob object with its name, default, documentation, whether every rank must agree on
// it, and its parser. Options::parse, Options::describe (meshmem-info), the cross-rank
// fingerprint and the README's table (meshmem-info --knobs-markdown) all read this table.
//
//   // in transport_foo.cpp:
//   const TuningKnob<std::size_t> kChunk{"foo", "MESHMEM_FOO_CHUNK", 1 << 20, parse_bytes, print_number,
//                                        "bytes per pipeline chunk"};
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

class Knob {
 public:
  // Adds the knob to the table. `group`: "core" (config.cpp only) or the part that declares
  // it ("ipc", "device", ...). Knobs are namespace-scope objects.
  Knob(const char* group, const char* name, const char* doc, bool must_agree);
  Knob(const Knob&) = delete;
  Knob& operator=(const Knob&) = delete;
  virtual ~Knob() = default;

  const char* group() const { return group_; }
  const char* name() const { return name_; }
  const char* doc() const { return doc_; }
  // Ranks that differ in this knob would choose different routes or protocols for one pair.
  bool must_agree() const { return must_agree_; }

  // Checks `raw` and stores it in `o`; raises Error(InvalidArgument) naming the variable.
  virtual void set(Options& o, const std::string& raw) const = 0;
  // The value `o` holds, in canonical text ("auto", "8192", "5000ms").
  virtual std::string text(const Options& o) const = 0;
  virtual std::string default_text() const = 0;

 private:
  const char* group_;
  const char* name_;
  const char* doc_;
  bool must_agree_;
};

// Every knob linked into this program: the core's in declaration order, then by group and
// name. A knob is in the table when its object file is linked: declare it in the file of
// the code that reads it (a transport's file is linked through the transport table).
std::vector<const Knob*> knob_table();
const Knob* find_knob(const std::string& name);

template <class T>
using KnobParser = T (*)(const char* name, const std::string& raw);
template <class T>
using KnobPrinter = std::string (*)(const T& value);

// A knob users set through the public Options (a field of it).
template <class T>
class OptionKnob final : public Knob {
 public:
  OptionKnob(const char* name, T Options::*field, KnobParser<T> parse, KnobPrinter<T> print, const char* doc,
             bool must_agree = true)
      : Knob("core", name, doc, must_agree), field_(field), parse_(parse), print_(print) {}
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
  TuningKnob(const char* group, const char* name, T def, KnobParser<T> parse, KnobPrinter<T> print,
             const char* doc, bool must_agree = true)
      : Knob(group, name, doc, must_agree), def_(std::move(def)), parse_(parse), print_(print) {}
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
//   const TuningKnob<Mode> kMode{"foo", "MESHMEM_FOO_MODE", Mode::Auto, parse_named<kModes>,
//                                print_named<kModes>, "..."};
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
