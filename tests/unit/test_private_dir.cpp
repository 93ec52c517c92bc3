// PrivateDir and the directory check of FdListener: a descriptor socket lives only in a
// directory that no other user may enter, so that no other user can connect to it at all.
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace
