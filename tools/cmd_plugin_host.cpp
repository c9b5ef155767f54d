// attnoracle plugin-host LIB JOBS: runs a plugin (conformance/include/attnoracle/plugin.h)
// through the adapter protocol; `attnoracle run --plugin LIB` starts it. Hidden from --help.
#include <memory>

#include "attnoracle/conformance/plugin_host.hpp"
#include "cli.hpp"

namespace attnoracle::cli {
namespace {

struct PluginHostArgs {
  std::string lib, jobs;
};

}  // namespace

Command add_plugin_host(CLI::App& app) {
  auto a = std::make_shared<PluginHostArgs>();
  CLI::App* sub = app.add_subcommand("plugin-host", "runs a plugin library on a jobs file");
  sub->group("");
  sub->add_option("LIB", a->lib, "plugin shared library")->required();
  sub->add_option("JOBS", a->jobs, "jobs file, one JSON object a line")->required();
  return {sub, [a] { return conformance::plugin_host_main(a->lib, a->jobs); }};
}

}  // namespace attnoracle::cli
