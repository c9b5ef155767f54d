// The attnoracle command: parses arguments and calls the libraries.
#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "attnoracle/conformance/keep_mask.hpp"
#include "attnoracle/conformance/stored_model.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/vectors/model_store.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/version.hpp"
#include "cli.hpp"

namespace {

[[noreturn]] void fail(const std::string& line) {
  std::cerr << "attnoracle: error: " << line << std::endl;
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace attnoracle;
  // gen --model and verify reach the gate's stored model through the vectors library's hooks
  vectors::install_model_store({[](const Case& c, SafeTensorsFile& golden) { conformance::put_model(c, golden); },
                                [](const Case& c, const SafeTensorsFile& golden) {
                                  (void)conformance::stored_model(c, golden, "");
                                }});
  // the gate's golden values of a case with the keep mask an implementation drew (run, check)
  conformance::set_case_evaluator([](const SafeTensorsFile& f) {
    const Case c = case_from_file("<returned dropout_mask>", f);
    return golden_file(c, evaluate(c, {}));
  });
  CLI::App app{"attnoracle: certified reference and conformance oracle for attention"};
  app.set_version_flag("--version", std::string(kNameAndVersion));
  app.require_subcommand(1);
  std::vector<cli::Command> commands = {cli::add_eval(app), cli::add_gen(app),
                                        cli::add_verify(app), cli::add_invariants(app),
                                        cli::add_run(app), cli::add_check(app), cli::add_merge(app), cli::add_report(app),
                                        cli::add_plugin_host(app)};

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fail(std::string("usage: ") + e.what() + " (see attnoracle --help)");
  }

  try {
    for (const auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const InputError& e) {
    fail(e.message());
  } catch (const std::bad_alloc&) {
    fail("out of memory");
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the command could not use (a link loop, a file where a directory is needed, ...).
    fail(printable(e.path1().string(), 500) + ": " + printable(e.code().message(), 200));
  } catch (const std::exception& e) {
    fail(printable(e.what(), 500));
  }
  return 2;
}
