// PrivateDir and the directory check of FdListener: a descriptor socket lives only in a
// directory that no other user may enter, so that no other user can connect to it at all.
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "meshmem/error.hpp"
#include "meshmem/ipc/fd_channel.hpp"

namespace {

using meshmem::Error;
using meshmem::ErrorCode;
using meshmem::ipc::FdListener;
using meshmem::ipc::PrivateDir;

TEST(PrivateDir, IsADirectoryOfThisUserWithMode0700AndGoesAwayWithItsSocket) {
  std::string path;
  {
    PrivateDir dir;
    path = dir.path();
    struct stat st {};
    ASSERT_EQ(::lstat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISDIR(st.st_mode));
    EXPECT_EQ(st.st_uid, ::geteuid());
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    FdListener listener(path + "/fd");
    EXPECT_EQ(::access((path + "/fd").c_str(), F_OK), 0);
  }
  EXPECT_EQ(::access(path.c_str(), F_OK), -1) << path << " is left behind";
}

TEST(PrivateDir, AListenerInADirectoryOthersMayEnterIsRefusedBeforeItBinds) {
  PrivateDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  try {
    FdListener l(dir.path() + "/s");
    FAIL() << "a listener in a directory of mode 0755";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("mode 0755"), std::string::npos) << e.what();
  }
  EXPECT_EQ(::access((dir.path() + "/s").c_str(), F_OK), -1) << "it bound all the same";
  try {
    FdListener l("/tmp/meshmem-test-" + std::to_string(::getpid()));  // /tmp: everyone's
    FAIL() << "a listener in /tmp";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
  }
}

// The directories of this machine's killed processes (their process gone, nobody listening on
// their socket, or no socket made in a minute) are removed when the next one is made; one
// whose process lives, whose socket someone listens on (a process of another pid namespace
// with that number), just made without its socket yet, of another machine sharing the
// directory, or not named like one, stays.
TEST(PrivateDir, DirectoriesThatKilledProcessesLeftAreRemovedAndNoOthers) {
  PrivateDir base;  // stands for TMPDIR
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", base.path().c_str(), 1);
  // A pid that no longer exists: a child that has exited and been reaped.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // This machine's tag: the first 8 hex digits of the kernel's boot id.
  std::string tag;
  {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string id;
    std::getline(in, id);
    for (char c : id)
      if (std::isxdigit(static_cast<unsigned char>(c)) && tag.size() < 8) tag += static_cast<char>(std::tolower(c));
    if (tag.size() != 8) tag = "00000000";
  }
  const std::string other = tag == "12345678" ? "87654321" : "12345678";  // another machine's
  const std::string dead = tag + "-" + std::to_string(child), alive = tag + "-" + std::to_string(::getpid());
  auto make = [&](const std::string& name, bool with_socket, bool listening) {
    const std::string dir = base.path() + "/" + name;
    EXPECT_EQ(::mkdir(dir.c_str(), 0700), 0) << dir;
    if (!with_socket) return std::unique_ptr<FdListener>();
    auto l = std::make_unique<FdListener>(dir + "/fd");
    if (!listening) {
      // The socket file stays, as a killed process leaves it; nobody listens on it.
      const std::string keep = dir + "/fd.keep";
      EXPECT_EQ(::link((dir + "/fd").c_str(), keep.c_str()), 0);
      l.reset();
      EXPECT_EQ(::rename(keep.c_str(), (dir + "/fd").c_str()), 0);
    }
    return l;
  };
  make("meshmem-" + dead + "-aaaaaa", true, false);              // killed: removed
  make("meshmem-" + dead + "-bbbbbb", false, false);             // killed before its socket, long ago: removed
  const std::string old_dir = base.path() + "/meshmem-" + dead + "-bbbbbb";
  const timeval long_ago[2] = {{::time(nullptr) - 3600, 0}, {::time(nullptr) - 3600, 0}};
  EXPECT_EQ(::utimes(old_dir.c_str(), long_ago), 0);
  make("meshmem-" + dead + "-ffffff", false, false);             // no socket yet, just made: stays
  make("meshmem-" + other + "-" + std::to_string(child) + "-gggggg", true, false);  // another machine's: stays
  auto other_ns = make("meshmem-" + dead + "-cccccc", true, true);  // someone listens: stays
  make("meshmem-" + alive + "-dddddd", true, false);             // its process lives: stays
  make("meshmem-notapid-eeeeee", false, false);                  // not one of ours: stays
  {
    PrivateDir fresh;
    EXPECT_EQ(fresh.path().rfind(base.path() + "/meshmem-" + alive + "-", 0), 0u) << fresh.path();
  }
  auto there = [&](const std::string& name) { return ::access((base.path() + "/" + name).c_str(), F_OK) == 0; };
  EXPECT_FALSE(there("meshmem-" + dead + "-aaaaaa"));
  EXPECT_FALSE(there("meshmem-" + dead + "-bbbbbb"));
  EXPECT_TRUE(there("meshmem-" + dead + "-cccccc"));
  EXPECT_TRUE(there("meshmem-" + alive + "-dddddd"));
  EXPECT_TRUE(there("meshmem-notapid-eeeeee"));
  EXPECT_TRUE(there("meshmem-" + dead + "-ffffff"));
  EXPECT_TRUE(there("meshmem-" + other + "-" + std::to_string(child) + "-gggggg"));
  other_ns.reset();
  if (old) ::setenv("TMPDIR", saved.c_str(), 1); else ::unsetenv("TMPDIR");
  // Left for `base` to remove: it removes files only, so empty the directories that stay.
  for (const char* name : {"-cccccc", "-dddddd"}) {
    const std::string dir = base.path() + "/meshmem-" + (name[1] == 'c' ? dead : alive) + name;
    (void)::unlink((dir + "/fd").c_str());
    (void)::rmdir(dir.c_str());
  }
  (void)::rmdir((base.path() + "/meshmem-notapid-eeeeee").c_str());
  (void)::rmdir((base.path() + "/meshmem-" + dead + "-ffffff").c_str());
  const std::string g = base.path() + "/meshmem-" + other + "-" + std::to_string(child) + "-gggggg";
  (void)::unlink((g + "/fd").c_str());
  (void)::rmdir(g.c_str());
}

}  // namespace
