// Node.js fs APIs (sync, promises, streams) on the directory given: every result printed, so that
// a run on a kura directory can be compared with one on a host directory. libuv stats files
// with statx(2) by number (syscall(3)), reads and writes through libc.
const fs = require("fs"), fsp = require("fs/promises"), path = require("path");
const D = process.argv[2];
const out = [];
const log = (...a) => out.push(a.map(x => typeof x === "string" ? x : JSON.stringify(x)).join(" "));
(async () => {
  fs.rmSync(D, { recursive: true, force: true });
  fs.mkdirSync(D + "/a/b/c", { recursive: true });
  fs.writeFileSync(D + "/a/f.txt", "hello world\n");
  fs.appendFileSync(D + "/a/f.txt", "more\n");
  let st = fs.statSync(D + "/a/f.txt");
  log("stat", st.size, st.isFile(), st.isDirectory(), st.nlink, (st.mode & 0o777).toString(8));
  log("lstat-dir", fs.lstatSync(D + "/a").isDirectory());
  fs.symlinkSync("f.txt", D + "/a/link");
  log("lstat-link", fs.lstatSync(D + "/a/link").isSymbolicLink(), fs.readlinkSync(D + "/a/link"), fs.statSync(D + "/a/link").size);
  log("realpath", path.relative(D, fs.realpathSync(D + "/a/link")));
  log("readdir", fs.readdirSync(D + "/a").sort(), fs.readdirSync(D + "/a", { withFileTypes: true }).map(e => e.name + ":" + (e.isDirectory() ? "d" : e.isSymbolicLink() ? "l" : "f")).sort());
  fs.copyFileSync(D + "/a/f.txt", D + "/a/copy.txt");
  log("copy", fs.readFileSync(D + "/a/copy.txt", "utf8").length);
  fs.renameSync(D + "/a/copy.txt", D + "/a/b/moved.txt");
  log("exists", fs.existsSync(D + "/a/copy.txt"), fs.existsSync(D + "/a/b/moved.txt"));
  fs.truncateSync(D + "/a/b/moved.txt", 5);
  log("trunc", fs.readFileSync(D + "/a/b/moved.txt", "utf8"));
  fs.chmodSync(D + "/a/b/moved.txt", 0o600);
  log("chmod", (fs.statSync(D + "/a/b/moved.txt").mode & 0o777).toString(8));
  fs.utimesSync(D + "/a/b/moved.txt", 1000, 2000);
  st = fs.statSync(D + "/a/b/moved.txt");
  log("utimes", st.atimeMs, st.mtimeMs);
  const fd = fs.openSync(D + "/a/big.bin", "w+");
  fs.writeSync(fd, Buffer.alloc(100000, 1), 0, 100000, 12345);
  fs.fsyncSync(fd);
  log("fstat", fs.fstatSync(fd).size);
  const b = Buffer.alloc(10); fs.readSync(fd, b, 0, 10, 12340);
  log("read", [...b]);
  fs.ftruncateSync(fd, 50000);
  log("ftrunc", fs.fstatSync(fd).size);
  fs.closeSync(fd);
  // promises (thread pool)
  await fsp.writeFile(D + "/p.json", JSON.stringify({ x: 1 }));
  const h = await fsp.open(D + "/p.json", "r+");
  await h.write("{\"x\":2}", 0);
  log("p-stat", (await h.stat()).size);
  await h.datasync(); await h.close();
  log("p-read", await fsp.readFile(D + "/p.json", "utf8"));
  log("p-readdir", (await fsp.readdir(D)).sort());
  log("p-access", await fsp.access(D + "/p.json").then(() => "ok", e => e.code));
  log("p-enoent", await fsp.stat(D + "/nope").then(() => "?", e => e.code));
  log("p-eexist", await fsp.mkdir(D + "/a").then(() => "?", e => e.code));
  log("p-enotempty", await fsp.rmdir(D + "/a").then(() => "?", e => e.code));
  const tmp = await fsp.mkdtemp(D + "/tmp-");
  log("mkdtemp", fs.statSync(tmp).isDirectory());
  const dir = await fsp.opendir(D + "/a"); const names = []; for await (const e of dir) names.push(e.name); log("opendir", names.sort());
  await fsp.cp(D + "/a", D + "/a2", { recursive: true });
  log("cp", fs.readdirSync(D + "/a2").sort(), fs.readFileSync(D + "/a2/b/moved.txt", "utf8"));
  // streams
  await new Promise((res, rej) => { const w = fs.createWriteStream(D + "/s.txt"); for (let i = 0; i < 1000; i++) w.write("line " + i + "\n"); w.end(); w.on("finish", res); w.on("error", rej); });
  let n = 0; await new Promise((res, rej) => fs.createReadStream(D + "/s.txt").on("data", c => n += c.length).on("end", res).on("error", rej));
  log("stream", n, fs.statSync(D + "/s.txt").size);
  log("statfs", typeof (await fsp.statfs(D)).bsize);
  fs.linkSync(D + "/s.txt", D + "/s2.txt");
  log("link", fs.statSync(D + "/s.txt").nlink);
  fs.rmSync(D + "/a", { recursive: true });
  log("rm", fs.existsSync(D + "/a"), fs.readdirSync(D).filter(x => !x.startsWith("tmp-")).sort());
  console.log(out.join("\n"));
})().catch(e => { console.log(out.join("\n")); console.log("FAIL", e.code, e.syscall, e.message); });
